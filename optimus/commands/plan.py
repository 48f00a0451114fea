"""`optimus plan`: one command, one parser, five modes.

    optimus plan [--nodes N | --world N] [--json] KEY=VALUE ...    memory and FLOPs per device (optimus.plan)
    optimus plan --dry-run [--rank R ...] [--imbalance X] [--device D] [--check-groups] [--out DIR]
                                                                  one real step on fake tensors (optimus.dry_run)
    optimus plan --predict [--nodes A,B,C | --world N] [--imbalance X] [--device D] [--json]
                                                                  the step time (optimus.perf.predict)
    optimus plan --search [--nodes N | --world N] [--device D] [--top K] [--verify K] [--jobs J] [--json]
                                                                  layouts ranked by predicted step (optimus.perf.search)
    optimus plan --calibrate --out DIR [--device D] [--nproc N] [--nodes N | --world N]
                                                                  this node measured, and the step's operators
                                                                  timed on it (optimus.selftest, perf.op_timing)

`parse` reads every mode's options at once and refuses, in one sentence and before any work, an option that the
mode given does not take; `main` runs the mode. The library modules it calls hold no command of their own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from optimus.config import ConfigError, OptimusConfig
from optimus.plan import STATE_KEYS, Plan, fits, gib


def main(argv: list[str]) -> int:
    """`optimus plan ...`: the mode's exit code."""
    mode, opts = parse(argv)
    run = {"plan": _plan, "dry-run": _dry_run, "predict": _predict, "calibrate": _calibrate, "search": _search}[mode]
    return run(opts)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="optimus plan",
        description="Predict per-device memory (parameters, gradients, optimizer state for each sharding scheme, "
        "activations with and without checkpointing) and FLOPs per step for a recipe on a layout.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--nodes",
        type=node_counts,
        help="nodes of machine.ranks_per_node ranks each; with --predict a list (32,64,128)",
    )
    where.add_argument("--world", type=int, help="total ranks (default: parallel.nproc)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    dry = p.add_argument_group("dry run", "one training step of the layout at its world size, on fake tensors")
    dry.add_argument("--dry-run", action="store_true", help="run one step of the real code for some ranks")
    dry.add_argument("--rank", type=int, action="append", help="a rank to run (repeatable; default: the busiest)")
    dry.add_argument(
        "--imbalance", type=float, help="the busiest expert's share of the routed tokens over the mean (default 1)"
    )
    dry.add_argument(
        "--device",
        help="the device path to trace: cpu, cuda, rocm or xpu (a GPU's step on a stand-in device, on any machine); "
        "default: the recipe's machine.device; with --calibrate the device to measure (default: machine.device)",
    )
    dry.add_argument("--out", help="write DIR/rank<R>.json (memory, collectives, host syncs) per rank")
    dry.add_argument("--overwrite", action="store_true", help="replace an earlier dry run's --out")
    dry.add_argument(
        "--check-groups", action="store_true", help="also run enough ranks to check that each group's members agree"
    )
    pred = p.add_argument_group("prediction", "the step time: dry runs of the step replayed on the machine's model")
    pred.add_argument(
        "--predict", action="store_true", help="step time, tokens/s, MFU and time split (optimus/perf/predict.py)"
    )
    search = p.add_argument_group("search", "layouts of the recipe at one world size, ranked by predicted step time")
    search.add_argument(
        "--search", action="store_true", help="search the layouts (optimus/perf/search.py); keys given are fixed"
    )
    search.add_argument("--top", type=int, help="layouts to print (default 10)")
    search.add_argument("--verify", type=int, help="fastest layouts whose busiest rank a dry run checks (default 2)")
    search.add_argument("--jobs", type=int, help="predictions at once, each its own process (default: one per core)")
    cal = p.add_argument_group(
        "calibration",
        "this node's rates and links, measured, as DIR/machine.yaml, and the operators of the recipe's step at "
        "--nodes/--world (default: this node's processes) timed on its devices, as DIR/operators.json",
    )
    cal.add_argument("--calibrate", action="store_true", help="measure this node and write --out DIR")
    cal.add_argument("--nproc", type=int, help="processes to measure with, one per device (default: one per GPU)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for `optimus train`")
    return p


# The options of each mode beyond --nodes, --world and the overrides.
OPTIONS = {
    "plan": ("json",),
    "dry-run": ("dry_run", "rank", "imbalance", "device", "out", "overwrite", "check_groups"),
    "predict": ("predict", "json", "imbalance", "device"),
    "calibrate": ("calibrate", "device", "out", "overwrite", "nproc"),
    "search": ("search", "json", "device", "top", "verify", "jobs"),
}


def parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """(the mode, its options): the mode is the flag given (--calibrate, else --dry-run, else --predict, else the
    memory plan), and each option it does not take, or that names something twice, is refused in one sentence
    before any work. --device left out stays None (the recipe's device: optimus.dry_run.dry_run_device);
    --imbalance left out stays None (optimus.load_model.checked_imbalance checks it against the model)."""
    opts = parser().parse_intermixed_args(argv)
    command = (
        "calibrate" if opts.calibrate else "dry-run" if opts.dry_run else "predict" if opts.predict
        else "search" if opts.search else "plan"
    )  # fmt: skip
    given = [name for names in OPTIONS.values() for name in names if _given(getattr(opts, name))]
    for name in dict.fromkeys(given):
        if name not in OPTIONS[command]:
            raise ConfigError(_not_taken(command, "--" + name.replace("_", "-")))
    for flag, values in (("--rank", opts.rank or []), ("--nodes", opts.nodes or [])):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise ConfigError(f"{flag} names {', '.join(map(str, twice))} more than once: name each once.")
    return command, opts


def _given(value) -> bool:
    """Whether an option was given: left out it is None, or False for a flag (by identity: 0.0 == False)."""
    return value is not None and value is not False


def _not_taken(command: str, flag: str) -> str:
    """Why `command` refuses `flag`, and what to run instead."""
    if command == "calibrate":
        return f"--calibrate measures this node and writes DIR/machine.yaml (--out DIR): leave out {flag}."
    if flag == "--calibrate":
        return "--calibrate is a command of its own (it measures this node): run `optimus plan --calibrate --out DIR`."
    if flag == "--nproc":
        return "--nproc belongs to `optimus plan --calibrate` (its processes on this node): leave it out."
    if flag in ("--top", "--verify", "--jobs"):
        return f"{flag} belongs to `optimus plan --search`: add --search, or leave it out."
    if flag == "--search" and command in ("predict", "dry-run"):
        return f"--{command} and --search are two commands (a search runs its own): run one of them."
    if command == "search":
        return f"--search runs its own predictions and dry runs and writes no files: leave out {flag}."
    if command == "predict":
        return f"--predict runs its own dry runs and writes no files: leave out {flag}."
    if command == "dry-run" and flag == "--predict":
        return "--dry-run and --predict are two commands (a prediction runs its own dry runs): run one of them."
    if command == "dry-run":
        return f"a dry run prints its summary and writes JSON only with --out DIR: leave out {flag}."
    if flag in ("--imbalance", "--device"):
        return f"{flag} belongs to a dry run or a prediction: add --dry-run or --predict, or leave it out."
    return f"{flag} belongs to a dry run: run `optimus plan --dry-run`."


def node_counts(text: str) -> list[int]:
    """--nodes 32 or --nodes 32,64,128."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nodes {text}: give one node count or a list (32,64)") from None
    return counts


def world_size(cfg: OptimusConfig, nodes: list[int] | int | None, world: int | None) -> int:
    from optimus.job_scripts import check_groups_in_node

    check_groups_in_node(cfg)  # the rule `optimus launch` applies: TP and EP groups inside one node of the machine
    if isinstance(nodes, list):
        if len(nodes) > 1:
            raise ConfigError(f"--nodes {','.join(map(str, nodes))}: a list of node counts needs --predict.")
        nodes = nodes[0]
    if nodes is not None:
        if nodes < 1:
            raise ConfigError(f"--nodes {nodes} must be at least 1.")
        if not cfg.machine.ranks_per_node:
            raise ConfigError(
                f"machine={cfg.machine.name} does not say how many ranks run per node: "
                "pass --world instead of --nodes, or set machine.ranks_per_node."
            )
        return nodes * cfg.machine.ranks_per_node
    if world is not None:
        if world < 1:
            raise ConfigError(f"--world {world} must be at least 1.")
        return world
    _check_default_world(cfg)
    return cfg.parallel.nproc


def _check_default_world(cfg: OptimusConfig) -> None:
    """Without --nodes or --world a plan is of parallel.nproc ranks: a cluster recipe's layout does not divide that,
    and the refusal says which option names the size."""
    from optimus.config_checks import layout_of

    try:
        layout_of(cfg, cfg.parallel.nproc)
    except ConfigError as err:
        why = f"with neither --nodes nor --world the world is parallel.nproc={cfg.parallel.nproc}"
        raise _size_refusal(err, why) from None


def _plan(opts: argparse.Namespace) -> int:
    """The memory and FLOPs plan, as text or --json: 0."""
    from optimus.plan import make_plan
    from optimus.recipes import load_config

    cfg = load_config(opts.overrides)
    plan = make_plan(cfg, world_size(cfg, opts.nodes, opts.world))
    sys.stdout.write((json.dumps(plan.as_dict(), indent=2) if opts.json else format_plan(plan)) + "\n")
    return 0


def _dry_run(opts: argparse.Namespace) -> int:
    """One real step of some ranks on fake tensors (optimus.dry_run): 0 when every traced group agrees and every
    traced rank's peak fits the device, 1 otherwise (the figures are printed all the same)."""
    from optimus.config_checks import layout_of
    from optimus.dry_run import (
        busiest_rank,
        check_dry_run_config,
        check_out,
        check_rank,
        dry_run_device,
        group_check_ranks,
        run_dry_runs,
        write_results,
    )  # fmt: skip
    from optimus.load_model import checked_imbalance
    from optimus.parallel.collective_trace import mismatches
    from optimus.plan import make_plan
    from optimus.recipes import load_config

    # Everything that can be refused is checked before the first rank's step, which can take minutes.
    cfg = load_config(opts.overrides)
    world = world_size(cfg, opts.nodes, opts.world)
    check_dry_run_config(cfg)
    device = dry_run_device(cfg, opts.device)  # the device path to trace
    imbalance = checked_imbalance(cfg.model.moe.n_experts, opts.imbalance)
    plan = make_plan(cfg, world)  # refuses a layout that does not divide
    layout = layout_of(cfg, world)
    ranks = list(opts.rank or [busiest_rank(plan, layout)])
    if opts.check_groups:
        ranks = sorted(set(ranks) | set(group_check_ranks(layout)))
    for rank in ranks:
        check_rank(rank, world)
    if opts.out:
        check_out(Path(opts.out), opts.overwrite)  # writable, and nothing of the user's to replace
    print(f"dry run of {len(ranks)} rank{'s' if len(ranks) != 1 else ''} of {world}: {ranks}", flush=True)
    results = run_dry_runs(cfg, world, ranks, imbalance, device)
    problems = mismatches({rank: r["collectives"] for rank, r in results.items()}) if opts.check_groups else []
    if opts.check_groups:
        print("group check: " + ("every traced group agrees" if not problems else f"{len(problems)} groups disagree"))
        for line in problems:
            print("  " + line)
    too_big = [rank for rank, r in results.items() if r["memory"]["fits"] is False]
    if too_big:
        print(f"DOES NOT FIT: the measured peak of ranks {too_big} is more than a device holds (machine.memory_gb)")
    if opts.out:
        summary = {"world": world, "ranks": ranks, "imbalance": imbalance, "device": device,
                   "group_check": opts.check_groups, "mismatches": problems, "does_not_fit": too_big}  # fmt: skip
        write_results(results, summary, Path(opts.out))
        print(f"wrote {opts.out}/rank<R>.json for ranks {ranks}")
    return 1 if problems or too_big else 0


def _predict(opts: argparse.Namespace) -> int:
    """The step time on the recipe's machine, at one node count or several (optimus.perf.predict): 0, or 1 where a
    predicted layout does not fit its device (said first; the figures are printed all the same; in --json each
    prediction's `fits`, `peak_bytes` and `device_bytes`)."""
    from optimus.dry_run import dry_run_device
    from optimus.load_model import checked_imbalance
    from optimus.perf.machine import MachineModel, machine_model, measured_here
    from optimus.perf.predict import (
        check_predictable,
        fit_lines,
        format_prediction,
        format_scaling,
        predict,
        scaling,
        scaling_json,
        scaling_points,
    )  # fmt: skip
    from optimus.recipes import load_config

    # Everything that can be refused is checked before the machine is measured and the step traced.
    cfg = load_config(opts.overrides)
    device = dry_run_device(cfg, opts.device)  # the device path the step is traced on
    imbalance = checked_imbalance(cfg.model.moe.n_experts, opts.imbalance)
    check_predictable(cfg)
    worlds = [world_size(cfg, [n], None) for n in opts.nodes] if opts.nodes else [world_size(cfg, None, opts.world)]
    models: dict[int, MachineModel] = {}

    def machine_for(world: int) -> MachineModel:
        if world not in models:
            models[world] = machine_model(cfg.machine, world)
        return models[world]

    if not measured_here(cfg.machine):  # a recipe's model: its machine.perf.* checked (machine=local is measured)
        for world in worlds:
            machine_for(world)
    points = scaling_points(cfg, worlds)  # every layout, strong and weak
    progress = "stderr" if opts.json else "stdout"
    layouts = [(p["strong"], p["world"]) for p in points if p["strong"] is not None]
    layouts += [(p["weak"], p["world"]) for p in points[1:]]  # the first world size's weak point is its strong one
    too_big = fit_lines(layouts)
    for line in too_big:  # first, before the minutes of work
        print(line, file=sys.stderr if opts.json else sys.stdout, flush=True)
    if len(worlds) == 1:
        prediction = predict(cfg, worlds[0], machine_for(worlds[0]), imbalance, progress, device)
        text, out = format_prediction(prediction), prediction.as_dict()
    else:
        rows = scaling(cfg, worlds, machine_for, imbalance, progress, device)
        text, out = format_prediction(rows[0]["strong"]) + format_scaling(rows), scaling_json(rows)
    print(json.dumps(out, indent=2) if opts.json else "\n".join(text))
    return 1 if too_big else 0


def _search(opts: argparse.Namespace) -> int:
    """The recipe's layouts at one world size ranked by predicted step time (optimus.perf.search): 0 when a layout
    fits and is predicted, 1 when none is; stopped (Ctrl-C), the layouts predicted so far, and 130."""
    import os

    from optimus.dry_run import dry_run_device
    from optimus.perf.machine import machine_model, measured_here
    from optimus.perf.search import Search, fixed_keys, format_search, search_json
    from optimus.recipes import load_config

    for flag, value, least in (("--top", opts.top, 1), ("--verify", opts.verify, 0), ("--jobs", opts.jobs, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} {value} must be at least {least}.")
    cfg = load_config(opts.overrides)
    if measured_here(cfg.machine):
        raise ConfigError(
            f"--search ranks layouts on a cluster's machine model; machine={cfg.machine.name} times each traced "
            "operator here, minutes per layout: choose a machine recipe (machine=aurora, frontier or nvidia)."
        )
    device = dry_run_device(cfg, opts.device)
    world = world_size(cfg, opts.nodes, opts.world)
    jobs = opts.jobs or len(os.sched_getaffinity(0))  # a dry run on fake tensors keeps one core busy
    out = sys.stderr if opts.json else sys.stdout
    search = Search(cfg, world, machine_model(cfg.machine, world), fixed_keys(opts.overrides), device, jobs,
                    say=lambda line: print(line, file=out, flush=True))  # fmt: skip
    stopped = False
    try:
        result = search.run(verify=2 if opts.verify is None else opts.verify)
    except KeyboardInterrupt:  # what was predicted is not lost: printed as the search's answer so far
        result, stopped = search.result(), True
        print(f"search stopped after {result.seconds:.0f} s: the layouts predicted so far", file=out, flush=True)
    if opts.json:
        print(json.dumps(search_json(result), indent=2))
    else:
        print("\n".join(format_search(result, cfg, opts.top or 10)))
    return 130 if stopped else 0 if result.ranked() else 1


def _calibrate(opts: argparse.Namespace) -> int:
    """This node's rates and collectives, and the traced step's operators on its devices, measured by the
    selftest's processes and written as DIR/machine.yaml and DIR/operators.json."""
    from dataclasses import replace

    from optimus.commands.selftest import CALIBRATE, prepare, run_command
    from optimus.output_dir import check_out_dir
    from optimus.ranks import discover
    from optimus.recipes import load_config

    if not opts.out:
        raise ConfigError("--calibrate writes DIR/machine.yaml: name the directory with --out DIR.")
    cfg = load_config(opts.overrides)
    job, nproc = prepare(cfg, opts.device, opts.nproc, kernels=None)
    info = discover()
    if info.rank == 0:  # refused before the step is traced, as run_command would after it
        check_out_dir(Path(opts.out), opts.overwrite, CALIBRATE.marker, CALIBRATE.what, CALIBRATE.files)
    given = opts.nodes is not None or opts.world is not None
    world = world_size(cfg, opts.nodes, opts.world) if given else nproc or info.world_size
    if info.rank == 0:  # under a launcher the others receive its operators when the processes meet (selftest_rank)
        traced = _step_operators(job.cfg, world, given, progress=True)
        if traced is not None:
            job = replace(job, signatures=tuple(traced[0]), step=traced[1])
    else:  # refused here as rank 0's trace would refuse it, rather than waiting for a rank 0 that has stopped
        _check_step_layout(job.cfg, world, given)
    return run_command(job, nproc, Path(opts.out), opts.overwrite, CALIBRATE)


def _check_step_layout(cfg: OptimusConfig, world: int, given: bool) -> None:
    """Refuse, in one sentence, a recipe whose layout does not divide the world the calibration traces."""
    from optimus.config_checks import validate

    try:
        validate(cfg, world)
    except ConfigError as err:
        raise _layout_refusal(err, world, given) from None


def _layout_refusal(err: ConfigError, world: int, given: bool) -> ConfigError:
    if given:
        return err
    why = f"--calibrate times the operators of the recipe's step, by default at this node's {world} processes"
    return _size_refusal(err, why)


def _size_refusal(err: ConfigError, why: str) -> ConfigError:
    """A layout refused at a world the user did not name: the refusal, why that world, and the options naming one."""
    return ConfigError(f"{str(err).rstrip('.')} ({why}: name the layout's size with --nodes N or --world N).")


def _step_operators(cfg: OptimusConfig, world: int, given: bool, progress: bool) -> tuple[list[str], str] | None:
    """(the distinct operators of the recipe's step at `world` ranks, traced on this node's device path; what
    that step is) for a calibration to time, or None (said on stderr) where no dry run can trace the recipe's
    step: the rates and links are calibrated without them."""
    from optimus.config_checks import layout_of
    from optimus.dry_run import check_dry_run_config
    from optimus.perf.op_timing import traced_signatures
    from optimus.perf.predict import trace_step
    from optimus.platform import detect_platform

    try:
        check_dry_run_config(cfg, "--calibrate")
    except ConfigError as err:
        if progress:
            print(f"optimus plan --calibrate: no operators timed: {err}", file=sys.stderr)
        return None
    path = detect_platform(cfg.machine, 0).path
    if progress:
        print(f"optimus plan --calibrate: the step at world {world} traced on the {path} path, to time its operators")
    try:
        traces = trace_step(cfg, world, progress="stdout" if progress else "none", device=path, signatures=True)
    except ConfigError as err:
        raise _layout_refusal(err, world, given) from None
    t, layout = cfg.train, layout_of(cfg, world)
    step = (
        f"model={cfg.model.name} at world {world} (pp {layout.pp}, tp {layout.tp}, ep {layout.ep}), micro-batch "
        f"{t.micro_batch} x {t.seq_len} tokens, kernels={cfg.kernels}, on the {path} path"
    )
    return traced_signatures(traces), step


# ---- the plan as text


def _fits(value: bool | None) -> str:
    return {None: "unknown (set machine.memory_gb)", True: "fits", False: "DOES NOT FIT"}[value]


def _verdict(total: float, device: float | None) -> str:
    """'X GiB -> fits (Y GiB free)' for one total against the device's memory."""
    free = f" ({gib(device - total)} free)" if fits(total, device) else ""
    return f"{gib(total)} -> {_fits(fits(total, device))}{free}"


def _verdict_line(mode: str, mem: dict) -> str:
    """The verdict as configured, then with no checkpointing and with full checkpointing where those differ."""
    device = mem["device_bytes"]
    line = f"device memory {gib(device)}: as configured (train.activation_checkpointing={mode}) "
    line += _verdict(mem["total_configured"], device)
    for other, key in (("none", "no_checkpointing"), ("full", "checkpointing")):
        if other != mode:
            line += f"; with {other} {_verdict(mem[f'total_{key}'], device)}"
    return line


def _update_line(update: dict) -> str:
    """What optim.update adds to a step: Muon's fp32 directions, held and gathered, against the parameter gather."""
    gather = f"the parameters' all-gather receives {gib(update['param_gather_received_bytes'])} per step"
    if update["rule"] != "muon":
        return f"optimizer update: {update['rule']}; {gather}"
    return (
        f"optimizer update: muon (AdamW state layout, no extra persistent bytes); during the step "
        f"+{gib(update['step_work_bytes'])} of fp32 update directions on the busiest rank (in the totals above "
        "where the step needs more than the backward), and its exchange of whole matrices "
        f"receives +{gib(update['gather_received_bytes'])} per step (run_info.json: each rank's own figures), "
        f"beside {gather}"
    )


def _staging_note(during: int, at_end: int) -> str:
    if not at_end:
        return ""
    return f" (with ZeRO-2's staged gradients: {gib(during)} in the backward, {gib(at_end)} at its end)"


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2,5-6'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def _layout_line(plan: Plan) -> str:
    """'layout: world W = PP x DP x TP' and how MoE layers fold a stage's DP x TP ranks into EDP x EP."""
    tp = f"TP {plan.tp}" + (" with sequence parallelism" if plan.sp else "")
    line = f"layout: world {plan.world} = PP {plan.pp} x DP {plan.dp} x {tp}"
    if plan.params["expert"]:
        line += f"; MoE layers: DP {plan.dp} x TP {plan.tp} = EDP {plan.edp} x EP {plan.ep} per stage"
    return line


def _shard_ranks_line(plan: Plan) -> list[str]:
    """With optim.shard_ranks: the sharded schemes' state is split over groups of that many ranks, replicated
    across the groups (hierarchical sharding)."""
    if plan.shard_ranks is None:
        return []
    return [
        f"optimizer state split over groups of {plan.shard_ranks} ranks, replicated across them (optim.shard_ranks)"
    ]


def format_plan(plan: Plan) -> str:
    p, f, mem = plan.params, plan.flops, plan.memory
    lines = [
        f"model {plan.model}: {p['total'] / 1e9:.3f}B parameters ({p['active'] / 1e9:.3f}B active), "
        f"dense {p['dense'] / 1e9:.3f}B, experts {p['expert'] / 1e9:.3f}B",
        _layout_line(plan),
        f"params and compute {plan.param_dtype}, grads {plan.grad_dtype}, fp32 master and moments, "
        f"ZeRO-{plan.zero}; {p['per_device'] / 1e9:.3f}B parameters on the busiest device",
        *_shard_ranks_line(plan),
        "",
        f"{'per device':<22}{'params':>12}{'grads':>12}{'fp32 master':>14}{'moments':>12}{'total':>12}",
    ]
    for scheme, s in plan.state.items():
        mark = " <- optim.sharding" if scheme == plan.sharding else ""
        total = sum(s[k] for k in STATE_KEYS)
        lines.append(
            f"  sharding={scheme:<11}{gib(s['param_bytes']):>12}{gib(s['grad_bytes']):>12}"
            f"{gib(s['master_bytes']):>14}{gib(s['optim_state_bytes']):>12}{gib(total):>12}{mark}"
        )
    if plan.stages:
        lines += ["", "pipeline ranks (the figures above are the busiest one's; optim.sharding and "
                  "train.activation_checkpointing as configured):",
                  f"  {'rank':<6}{'layers':<16}{'params':>10}{'on device':>11}{'state':>12}{'in flight':>11}"
                  f"{'activations':>13}{'total':>12}"]  # fmt: skip
        for row in plan.stages:
            held = (
                _layer_ranges(row["layers"]) + (" +embed" if row["embed"] else "") + (" +head" if row["head"] else "")
            )
            lines.append(
                f"  {row['pp_rank']:<6}{held:<16}{row['params'] / 1e9:>9.2f}B{row['params_per_device'] / 1e9:>10.2f}B"
                f"{gib(row['state_bytes']):>12}"
                f"{row['in_flight']:>11.3g}{gib(row['activation_bytes']):>13}{gib(row['total_bytes']):>12}"
                f"  {_fits(row['fits'])}"
            )
    act = plan.activations
    sequences = f"{act['micro_batch']} sequence{'s' if act['micro_batch'] != 1 else ''}"
    lines += [
        "",
        (
            f"activations of the busiest pipeline rank (its micro-batches in flight, of {sequences} each)"
            if plan.stages
            else f"activations per micro-batch of {sequences}"
        )
        + ": train.activation_checkpointing="
        f"none {gib(act['no_checkpointing'])}, selective {gib(act['selective'])}, full {gib(act['checkpointing'])}"
        + _staging_note(*act["zero2_staging"]),
        _verdict_line(act["configured_mode"], mem),
        "  (not counted: the runtime's context and collective buffers, allocator caching and fragmentation, "
        "routing imbalance; docs/MEMORY.md)",
        _update_line(plan.update),
        "",
        f"FLOPs: {f['per_token']:.4g} per token, {f['per_step']:.4g} per step, {f['per_device_per_step']:.4g} "
        "per device per step"
        + (f"; {f['step_time_at_peak_s']:.3g} s per step at 100% MFU" if f["step_time_at_peak_s"] else ""),
    ]
    return "\n".join(lines)
