"""The performance model (`optimus plan --predict`) against measured and published step times.

    python benchmarks/predict.py local [--repeats 3] [--out benchmarks/results]
        real `optimus train` runs on this machine (gloo, 1 and 2 processes, several layouts), each layout's
        prediction from the `local` machine model measured between two of its runs, every layout --repeats
        times: predict_local.{md,json}
    python benchmarks/predict.py studies [--out benchmarks/results] [--cache DIR]
        the Frontier study's 22B / 175B / 1T figures and the Aurora MoE study's 220B-A10B scaling beside the
        predictions for the experiment recipes, and a sensitivity table (each machine number halved and
        doubled): predict_studies.json. The dry runs take minutes each; their traces are kept in --cache.
    python benchmarks/predict.py recipes [--out benchmarks/results] [--cache DIR] [--device D] [--name SUFFIX]
                                         [--only LAYOUT ...]
        every experiment recipe at benchmarks/dry_run.py's world sizes, traced on its recipe's device path (or
        --device's), with its interval and what each ranged machine number does to it alone:
        predict_recipes<SUFFIX>.json (with --only, those layouts' rows replaced, the others kept)
    python benchmarks/predict.py mfu [--out benchmarks/results] [--cache DIR]
        the Frontier study's three MFU points, traced on the recipes' device path, each with its interval
        (the machine's ranges at both ends): predict_mfu_device.json
    python benchmarks/predict.py scaling --only RECIPE ... [--out benchmarks/results] [--cache DIR]
        the published scaling series of those recipes (PUBLISHED_SCALING), traced on the recipes' device path,
        with each efficiency's range: predict_scaling_device.json
    python benchmarks/predict.py alltoall [--out benchmarks/results] [--cache DIR]
        the 220B-A10B with its expert-parallel group inside a node and across nodes, on each library's machine:
        the step, its exposed expert exchange and the all-to-all's batches of rounds:
        predict_all_to_all_device.json
    python benchmarks/predict.py recipes --name _searched --only LAYOUT ...
        the recipes `optimus plan --search` re-laid, beside predict_recipes_device.json's hand-written layouts
    python benchmarks/predict.py tables
        the markdown tables of benchmarks/results/predict.md from its JSON files (its text is written by hand
        around them)

The local runs are timed one after another on an otherwise idle machine; each `optimus train` step time is the
median of its steps after the first three, and each prediction is made between two runs of its layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from memory import ADAMW, cpu_flags  # noqa: E402  benchmarks/ is first on sys.path

from optimus.config import ConfigError  # noqa: E402
from optimus.perf.machine import MachineModel, machine_model  # noqa: E402

# Layouts of the default tiny model this machine can run, each with its process count.
LOCAL_LAYOUTS = [
    ("1 process", 1, []),
    ("1 process, 2 micro-batches", 1, ["train.global_batch=16"]),
    ("1 process, fp32", 1, ["train.dtype=fp32"]),
    ("2 processes, dp 2", 2, ["train.global_batch=16"]),
    ("2 processes, ep 2", 2, ["parallel.ep=2", "train.global_batch=16"]),
    ("2 processes, pp 2 (1F1B, 4 micro-batches)", 2, ["parallel.pp=2", "train.micro_batch=2"]),
    ("2 processes, tp 2", 2, ["parallel.tp=2"]),
]
STEPS, SKIP = 10, 3


def measured_step(nproc: int, overrides: list[str]) -> tuple[float, float]:
    """(median step seconds, mean expert_load_imbalance) of the timed steps of a real `optimus train`."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "optimus", "train", f"parallel.nproc={nproc}", f"train.steps={STEPS}",
               "train.log_interval=1", "train.eval_interval=1000", f"run.dir={tmp}/run", *overrides]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
    steps = [r for r in records if "step_time_s" in r][SKIP:]
    return statistics.median(r["step_time_s"] for r in steps), statistics.mean(
        r["expert_load_imbalance"] for r in steps
    )


def predicted_step(nproc: int, overrides: list[str], imbalance: float = 1.0) -> dict:
    cmd = [sys.executable, "-m", "optimus", "plan", "--predict", "--json", "--world", str(nproc),
           "--imbalance", f"{imbalance:.3f}", f"parallel.nproc={nproc}", *overrides]  # fmt: skip
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def roofline_step(nproc: int, overrides: list[str], imbalance: float, machine_numbers: dict) -> float:
    """The prediction on the same measured machine with every operator priced by the roofline instead of
    timed (what machine=local predicted before it timed the traced operators)."""
    from optimus.perf.predict import prediction_of, trace_step
    from optimus.recipes import load_config

    cfg = load_config([f"parallel.nproc={nproc}", *overrides])
    machine = MachineModel.from_dict({**machine_numbers, "op_threads": 0})
    return prediction_of(cfg, nproc, machine, trace_step(cfg, nproc, imbalance, progress="none")).step_time_s


def local_row(label: str, nproc: int, layout: list[str]) -> dict:
    """One layout measured and predicted side by side: a real run, the prediction (its operators timed now, at the
    run's imbalance), a second real run; the prediction set against the two runs' mean, so that the machine's
    drift during the minute they take moves both sides alike."""
    overrides = [*ADAMW, *layout]
    before, imbalance = measured_step(nproc, overrides)
    predicted = predicted_step(nproc, overrides, imbalance)
    after, _ = measured_step(nproc, overrides)
    measured = (before + after) / 2
    roofline = roofline_step(nproc, overrides, imbalance, predicted["machine_numbers"])
    return {"layout": label, "nproc": nproc, "overrides": layout, "measured_s": measured,
            "measured_runs_s": [before, after], "imbalance": imbalance, "predicted_s": predicted["step_time_s"],
            "time_split": predicted["time_split"], "error": predicted["step_time_s"] / measured - 1,
            "roofline_s": roofline, "roofline_error": roofline / measured - 1,
            "machine_numbers": predicted["machine_numbers"]}  # fmt: skip


def run_local(out: Path, repeats: int) -> None:
    repeats_rows = []
    for repeat in range(repeats):
        rows = []
        for label, nproc, layout in LOCAL_LAYOUTS:
            row = local_row(label, nproc, layout)
            rows.append(row)
            print(f"repeat {repeat + 1}, {label}: measured {row['measured_s']:.3f} s (runs "
                  f"{row['measured_runs_s'][0]:.3f}, {row['measured_runs_s'][1]:.3f}; imbalance "
                  f"{row['imbalance']:.2f}), predicted {row['predicted_s']:.3f} s ({100 * row['error']:+.1f}%), "
                  f"roofline only {row['roofline_s']:.3f} s", flush=True)  # fmt: skip
        repeats_rows.append(rows)
    info = {"cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "torch": __import__("torch").__version__}
    (out / "predict_local.json").write_text(json.dumps({"machine": info, "repeats": repeats_rows}, indent=1))
    lines = [
        "# Predicted against measured step times on this machine",
        "",
        f"`python benchmarks/predict.py local --repeats {repeats}`. Machine: {info['cpus']} CPUs "
        f"({info['cpu_flags']}), torch {info['torch']}. Each layout, in turn: a real `optimus train` (default model "
        f"and data, AdamW, {STEPS} steps, the median step time after the first {SKIP}, and the mean of its "
        "`expert_load_imbalance` over them), then `optimus plan --predict --json --world N --imbalance X` with "
        "the same overrides and X that run's imbalance, from the `local` machine model it measures then (every "
        "operator of the traced step timed here; gloo's latency and bandwidth; a collective's wake-up and the "
        "ranks' variability), then the same real run again; "
        "measured is the two runs' mean. Roofline only: the same traces and machine numbers, each operator "
        "priced by the roofline of the measured rates plus the host's time per operator instead of timed. "
        "Nothing else running.",
        "",
        "| layout | " + " | ".join(f"repeat {i + 1}: measured s (runs) | predicted s | error" for i in range(repeats))
        + " | roofline only, error by repeat | predicted split, last repeat (s) |",
        "|---|" + "---|---|---|" * repeats + "---|---|",
    ]  # fmt: skip
    for i, (label, _, _) in enumerate(LOCAL_LAYOUTS):
        cells = []
        for rows in repeats_rows:
            r = rows[i]
            runs = ", ".join(f"{t:.3f}" for t in r["measured_runs_s"])
            cells.append(f"{r['measured_s']:.3f} ({runs}) | {r['predicted_s']:.3f} | {100 * r['error']:+.1f}%")
        roofline = ", ".join(f"{100 * rows[i]['roofline_error']:+.1f}%" for rows in repeats_rows)
        last = repeats_rows[-1][i]
        split = ", ".join(f"{k} {v:.3f}" for k, v in sorted(last["time_split"].items(), key=lambda kv: -kv[1]) if v)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {roofline} | {split} |")
    worst = max(abs(rows[i]["error"]) for rows in repeats_rows for i in range(len(LOCAL_LAYOUTS)))
    two = [r["machine_numbers"] for rows in repeats_rows for r in rows if r["nproc"] > 1]
    wake = sorted(1e3 * m["sync_cost"] for m in two)
    cv = sorted(100 * m["rank_variability"] for m in two)
    lines += ["", f"Largest error over every layout and repeat: {100 * worst:.1f}%. The two-process layouts' "
              f"machines measured a collective's wake-up (`sync_cost`, optimus.perf.rank_sync) of "
              f"{wake[0]:.2f}-{wake[-1]:.2f} ms and the ranks' variability of {cv[0]:.1f}-{cv[-1]:.1f}%."]  # fmt: skip
    (out / "predict_local.md").write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------
# The studies


def traces_for(
    recipe: str, nodes: int, cache: Path, extra: tuple[str, ...] = (), weak_from: int = 0, device: str | None = None
) -> tuple:
    """(cfg, world, traces) of an experiment recipe (with `extra` overrides) at `nodes`, its global batch grown
    from `weak_from` nodes when given (weak scaling); traced, or from the cache, where a trace is filed under
    a digest of the whole config it ran (two overrides that give the same config share it)."""
    from optimus.dry_run import dry_run_device
    from optimus.perf.predict import scaled_batch, trace_step
    from optimus.perf.step_trace import FORMAT
    from optimus.recipes import load_config

    cfg = load_config([f"experiment={recipe}", *extra])
    cfg = scaled_batch(cfg, nodes, weak_from) if weak_from else cfg
    world = nodes * cfg.machine.ranks_per_node
    device = dry_run_device(cfg, device)  # the recipe's device path, unless --device names one
    digest = hashlib.sha1(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode()).hexdigest()
    path = cache / f"{recipe}-{nodes}-{cfg.train.global_batch}-{device}-{digest[:10]}.v{FORMAT}.json.gz"
    if path.exists():
        traces = {int(k): v for k, v in json.loads(gzip.decompress(path.read_bytes())).items()}
    else:
        print(f"{recipe} on {nodes} nodes, global batch {cfg.train.global_batch}, {device} path:", flush=True)
        traces = trace_step(cfg, world, device=device)
        path.write_bytes(gzip.compress(json.dumps(traces).encode()))
    return cfg, world, traces


# Published: (recipe, nodes, MFU) from Dash et al. (Frontier); scaling from both studies.
PUBLISHED_MFU = [("frontier-22b", 16, 0.3838), ("frontier-175b", 128, 0.3614), ("frontier-1t", 384, 0.3196)]
# The predictions the sensitivity table perturbs: the Frontier study's three and the Aurora MoE recipe.
SENSITIVITY_OF = [("frontier-22b", 16), ("frontier-175b", 128), ("frontier-1t", 384), ("aurora-mula-220b-a10b", 256)]
# (recipe, node counts, published efficiencies, source, recipe overrides): weak scaling keeps the batch per
# rank of the first node count, strong scaling its global batch. The Frontier series scale up from the
# recipes' study-sized point (tracing a smaller world replays more micro-batches per rank: hours here).
PUBLISHED_SCALING = [
    ("frontier-175b", [128, 256], {"weak": 1.00, "strong": 0.89}, "Dash et al.: 175B to 1,024 GCDs", ()),
    (
        "aurora-mula-220b-a10b",
        [32, 128, 1024],
        {"weak": 0.90},
        "Aurora MoE study: 384 to 12,288 tiles",
        ("train.global_batch=384",),
    ),  # 8 micro-batches per data-parallel rank, as the recipe at 256 nodes
    ("frontier-1t", [384, 768], {"weak": 1.00, "strong": 0.87}, "Dash et al.: 1T to 3,072 GCDs", ()),
]
# The machine numbers the sensitivity table halves and doubles, one at a time.
SENSITIVITY = [
    "gemm_efficiency", "memory_bandwidth", "kernel_floor", "package.bandwidth", "node.bandwidth",
    "network.bandwidth", "package.latency", "node.latency", "network.latency",
]  # fmt: skip


def _scaled(machine: MachineModel, key: str, factor: float) -> MachineModel:
    """The machine with one number scaled (`link.field` for a link's; efficiencies stay at most 1), without
    ranges: a sensitivity point needs the step, not its interval."""
    machine = machine.with_values(ranges={})
    if "." in key:
        link, field = key.split(".")
        value = getattr(machine, link)
        return machine.with_values(**{link: dataclasses.replace(value, **{field: getattr(value, field) * factor})})
    if key == "gemm_efficiency":  # attention's efficiency moves with it where the recipe leaves it at the same
        return machine.with_values(
            gemm_efficiency=min(machine.gemm_efficiency * factor, 1.0),
            attention_efficiency=min(machine.attention_efficiency * factor, 1.0),
        )
    return machine.with_values(**{key: getattr(machine, key) * factor})


def run_recipes(
    out: Path, cache: Path, device: str | None = None, suffix: str = "", only: list[str] | None = None
) -> None:
    """Every experiment recipe at the world size of benchmarks/dry_run.py's table; with `only`, those layouts,
    their rows replacing their earlier ones in the results file and the other rows kept."""
    from dry_run import LAYOUTS

    from optimus.perf.predict import prediction_of

    unknown = sorted(set(only or ()) - {name for name, _, _ in LAYOUTS})
    if unknown:
        raise SystemExit(f"--only {' '.join(unknown)}: not a layout of benchmarks/dry_run.py's LAYOUTS.")
    cache.mkdir(parents=True, exist_ok=True)
    results = out / f"predict_recipes{suffix}.json"
    rows = json.loads(results.read_text()) if only and results.exists() else []
    # The studies' points last: `studies` traces them too, and the second to arrive reads them from the cache.
    order = sorted(LAYOUTS, key=lambda layout: layout[0] in ("frontier-175b", "frontier-1t"))
    for name, overrides, nodes in order:
        if only and name not in only:
            continue
        recipe = overrides[0].removeprefix("experiment=")
        cfg, world, traces = traces_for(recipe, nodes, cache, tuple(overrides[1:]), device=device)
        machine = machine_model(cfg.machine)
        pred = prediction_of(cfg, world, machine, traces)
        effects = range_effects(cfg, world, machine, traces)
        algorithms = collective_algorithms(machine, traces)
        without = steps_without(cfg, world, machine, traces)
        new_row = {"layout": name, "nodes": nodes, **pred.as_dict(), "range_effects": effects,
                   "collective_algorithms": algorithms, "step_time_s_without": without}  # fmt: skip
        rows = [row for row in rows if row["layout"] != name] + [new_row]
        place = {layout: i for i, (layout, _, _) in enumerate(LAYOUTS)}  # rows in the table's order
        rows.sort(key=lambda row: place.get(row["layout"], len(place)))
        results.write_text(json.dumps(rows, indent=1))


def steps_without(cfg, world: int, machine: MachineModel, traces: dict) -> dict[str, float]:
    """The step at the recipe's numbers without one of the model's parts: the library's algorithms (every
    collective a flat ring, as gloo runs them) or the wait for the slowest rank."""
    from optimus.perf.predict import predict_from_traces

    plain = machine.with_values(ranges={})
    return {
        "vendor_algorithms": predict_from_traces(cfg, world, plain.with_values(library="ring"), traces)[0],
        "stragglers": predict_from_traces(cfg, world, plain.with_values(rank_variability=0.0), traces)[0],
    }


def collective_algorithms(machine: MachineModel, traces: dict) -> dict[str, dict[str, int]]:
    """Per collective operation of the traced ranks, how many calls each algorithm takes: the choice of the
    machine's library (optimus.perf.collectives), at the recipe's numbers."""
    from optimus.perf.costs import collective_cost

    tally = defaultdict(Counter)
    for trace in traces.values():
        for event in trace["events"]:
            if event["e"] == "comm":
                tally[event["call"]["op"]][collective_cost(machine, event["call"], trace["rank"])[0]] += 1
    return {op: dict(sorted(counts.items())) for op, counts in sorted(tally.items())}


def range_effects(cfg, world: int, machine: MachineModel, traces: dict) -> dict[str, list[float]]:
    """What each ranged number of the recipe (machine.perf.ranges) does to the step alone: {number: [change at
    its fast end, at its slow end]} as fractions of the point, the other numbers at their recipe values. A
    number stands for those that take its value where the recipe leaves them null (attention's efficiency the
    GEMM's, the package link the node's): they move with it."""
    from optimus.perf.machine import model_ranges
    from optimus.perf.predict import predict_from_traces

    perf = cfg.machine.perf
    point = predict_from_traces(cfg, world, machine.with_values(ranges={}), traces)[0]
    effects = {}
    for key, bounds in perf.ranges.items():
        alone = machine.with_values(ranges=model_ranges(dataclasses.replace(perf, ranges={key: bounds})))
        ends = [predict_from_traces(cfg, world, alone.at_end(end), traces)[0] for end in ("fast", "slow")]
        effects[key] = [t / point - 1 for t in ends]
    return effects


def run_studies(out: Path, cache: Path) -> None:
    from optimus.perf.predict import prediction_of

    cache.mkdir(parents=True, exist_ok=True)
    result = {"mfu": [], "scaling": [], "sensitivity": []}
    for recipe, nodes, published in PUBLISHED_MFU:
        cfg, world, traces = traces_for(recipe, nodes, cache)
        machine = machine_model(cfg.machine)
        pred = prediction_of(cfg, world, machine, traces)
        result["mfu"].append({"recipe": recipe, "nodes": nodes, "published_mfu": published, **pred.as_dict()})
    for recipe, nodes in SENSITIVITY_OF:
        cfg, world, traces = traces_for(recipe, nodes, cache)
        machine = machine_model(cfg.machine)
        base = prediction_of(cfg, world, machine, traces).step_time_s
        for key in SENSITIVITY:
            moved = {f: prediction_of(cfg, world, _scaled(machine, key, f), traces).step_time_s / base - 1
                     for f in (0.5, 2.0)}  # fmt: skip
            result["sensitivity"].append({"recipe": recipe, "parameter": key, "x0.5": moved[0.5], "x2": moved[2.0]})
        _write_studies(out, result)
    for recipe, node_counts, published, source, extra in PUBLISHED_SCALING:
        result["scaling"].append(scaling_series(recipe, node_counts, published, source, extra, cache))
        _write_studies(out, result)


def scaling_series(recipe: str, node_counts: list[int], published: dict, source: str, extra: tuple, cache: Path):
    """One of PUBLISHED_SCALING's series: per node count the strong (where published) and weak predictions, each
    with its efficiency against the first count and the efficiency's range (optimus.perf.predict.efficiencies)."""
    from optimus.perf.predict import efficiencies, prediction_of

    predictions = []
    for nodes in node_counts:
        point = {"nodes": nodes}
        for mode, weak_from in (("strong", 0), ("weak", node_counts[0])):
            if mode == "strong" and "strong" not in published:
                continue
            try:
                cfg, world, traces = traces_for(recipe, nodes, cache, extra, weak_from)
            except ConfigError as refused:  # a layout that does not divide the batch
                point[mode] = str(refused)
                continue
            point[mode] = prediction_of(cfg, world, machine_model(cfg.machine), traces)
        predictions.append(point)
    rows = []
    for point in predictions:
        row = {"nodes": point["nodes"]}
        for mode in ("strong", "weak"):
            base, here = predictions[0].get(mode), point.get(mode)
            if isinstance(here, str):
                row[mode] = {"refused": here}
            elif here is not None:
                row[mode] = here.as_dict()
                if base is not None and not isinstance(base, str):
                    row[f"{mode}_efficiency"], row[f"{mode}_efficiency_range"] = efficiencies(mode, base, here)
        rows.append(row)
    return {"recipe": recipe, "overrides": list(extra), "source": source, "published": published, "rows": rows}


def run_scaling(out: Path, cache: Path, only: list[str] | None) -> None:
    """PUBLISHED_SCALING's series of the recipes in `only`, traced on each recipe's device path, replacing those
    recipes' series in predict_scaling_device.json and keeping the others."""
    if not only:
        raise SystemExit(
            "scaling needs --only RECIPE ...: one or more of " + ", ".join(s[0] for s in PUBLISHED_SCALING)
        )
    unknown = sorted(set(only) - {series[0] for series in PUBLISHED_SCALING})
    if unknown:
        raise SystemExit(f"--only {' '.join(unknown)}: not a recipe of PUBLISHED_SCALING.")
    cache.mkdir(parents=True, exist_ok=True)
    results = out / "predict_scaling_device.json"
    kept = [s for s in json.loads(results.read_text()) if s["recipe"] not in only] if results.exists() else []
    new = [scaling_series(*s, cache) for s in PUBLISHED_SCALING if s[0] in only]
    order = [s[0] for s in PUBLISHED_SCALING]
    results.write_text(json.dumps(sorted(kept + new, key=lambda s: order.index(s["recipe"])), indent=1))


def run_mfu(out: Path, cache: Path) -> None:
    """The Frontier study's MFU points (PUBLISHED_MFU) on each recipe's device path, with their intervals."""
    from optimus.perf.predict import prediction_of

    cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for recipe, nodes, published in PUBLISHED_MFU:
        cfg, world, traces = traces_for(recipe, nodes, cache)  # the recipe's device path
        pred = prediction_of(cfg, world, machine_model(cfg.machine), traces)
        checkpointing = cfg.train.activation_checkpointing
        rows.append({"recipe": recipe, "nodes": nodes, "published_mfu": published,
                     "activation_checkpointing": checkpointing, **pred.as_dict()})  # fmt: skip
        (out / "predict_mfu_device.json").write_text(json.dumps(rows, indent=1))


# (recipe, nodes, overrides): the 220B-A10B with its expert-parallel group inside a node (the recipes') and
# across 4-6 nodes (ep 48), on each library's machine.
EP_ACROSS_NODES = [
    ("frontier-mula-220b-a10b", 384, ("machine=nvidia", "machine.peak_flops=989e12")),
    ("frontier-mula-220b-a10b", 384, ("machine=nvidia", "machine.peak_flops=989e12", "parallel.ep=48")),
    ("frontier-mula-220b-a10b", 384, ()),
    ("frontier-mula-220b-a10b", 384, ("parallel.ep=48",)),
    ("aurora-mula-220b-a10b", 256, ()),
    ("aurora-mula-220b-a10b", 256, ("parallel.ep=48",)),
]


def run_all_to_all(out: Path, cache: Path) -> None:
    """EP_ACROSS_NODES on their device path: the step, its exposed expert exchange and the all-to-alls' batches
    of rounds (optimus.perf.collectives.all_to_all_rounds)."""
    from optimus.perf.collectives import all_to_all_rounds
    from optimus.perf.predict import prediction_of

    cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for recipe, nodes, extra in EP_ACROSS_NODES:
        cfg, world, traces = traces_for(recipe, nodes, cache, extra)
        machine = machine_model(cfg.machine)
        pred = prediction_of(cfg, world, machine, traces)
        batches = len(all_to_all_rounds(machine.library, cfg.parallel.ep))
        rows.append({"recipe": recipe, "nodes": nodes, "overrides": list(extra), "ep": cfg.parallel.ep,
                     "ranks_per_node": cfg.machine.ranks_per_node, "library": machine.library,
                     "batches": batches, **pred.as_dict()})  # fmt: skip
        (out / "predict_all_to_all_device.json").write_text(json.dumps(rows, indent=1))


def print_all_to_all_table(out: Path) -> None:
    rows = json.loads((out / "predict_all_to_all_device.json").read_text())
    print("| recipe | machine | library | ep (nodes it spans) | batches of rounds | step s | exposed expert exchange s "
          "| MFU |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        spans = -(-r["ep"] // r["ranks_per_node"])
        exchange = r["time_split"].get("exposed_expert_exchange", 0.0)
        print(f"| {r['recipe']} | {r['machine']} | {r['library']} | {r['ep']} ({spans}) | {r['batches']} | "
              f"{r['step_time_s']:.2f} | {exchange:.3f} ({100 * exchange / r['step_time_s']:.0f}%) | "
              f"{100 * r['mfu']:.1f}% |")  # fmt: skip


def _write_studies(out: Path, result: dict) -> None:
    (out / "predict_studies.json").write_text(json.dumps(result, indent=1))


def _split_cell(split: dict, step: float) -> str:
    top = sorted(split.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k.removeprefix('exposed_')} {100 * v / step:.0f}%" for k, v in top if v / step >= 0.005)


def print_tables(out: Path) -> None:
    """The markdown tables of predict.md from predict_studies.json and predict_recipes.json."""
    studies = json.loads((out / "predict_studies.json").read_text())
    print("| recipe | nodes (devices) | global batch | predicted step s | predicted TFLOPS/device | predicted MFU | "
          "published MFU | point difference | predicted split |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in studies["mfu"]:
        error = r["mfu"] / r["published_mfu"] - 1
        print(f"| {r['recipe']} | {r['nodes']:g} ({r['world']}) | {r['global_batch']} | {r['step_time_s']:.2f} | "
              f"{r['tflops_per_device']:.1f} | {100 * r['mfu']:.1f}% | {100 * r['published_mfu']:.2f}% | "
              f"{100 * error:+.0f}% | {_split_cell(r['time_split'], r['step_time_s'])} |")  # fmt: skip
    print()
    print("| recipe | nodes | mode | global batch | predicted step s | predicted MFU | predicted efficiency | "
          "published | split |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for series in studies["scaling"]:
        for row in series["rows"]:
            for mode in ("strong", "weak"):
                pred = row.get(mode)
                if pred is None:
                    continue
                if "refused" in pred:
                    print(f"| {series['recipe']} | {row['nodes']} | {mode} | | refused: {pred['refused']} | | | | |")
                    continue
                eff = row.get(f"{mode}_efficiency")
                published = series["published"].get(mode)
                print(f"| {series['recipe']} | {row['nodes']} | {mode} | {pred['global_batch']} | "
                      f"{pred['step_time_s']:.2f} | {100 * pred['mfu']:.1f}% | "
                      f"{'-' if eff is None else f'{100 * eff:.1f}%'} | "
                      f"{'-' if published is None else f'{100 * published:.0f}%'} | "
                      f"{_split_cell(pred['time_split'], pred['step_time_s'])} |")  # fmt: skip
    print()
    print("| recipe | parameter | step time, parameter x0.5 | step time, x2 |")
    print("|---|---|---|---|")
    for r in sorted(studies["sensitivity"], key=lambda r: (r["recipe"], -abs(r["x0.5"]) - abs(r["x2"]))):
        print(f"| {r['recipe']} | {r['parameter']} | {100 * r['x0.5']:+.1f}% | {100 * r['x2']:+.1f}% |")
    print()
    recipes = json.loads((out / "predict_recipes.json").read_text())
    print("| layout | devices | predicted step s | tokens/s | TFLOPS/device | MFU | split |")
    print("|---|---|---|---|---|---|---|")
    for r in recipes:
        split = _split_cell(r["time_split"], r["step_time_s"])
        print(f"| {r['layout']} | {r['world']} | {r['step_time_s']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{r['tflops_per_device']:.1f} | {100 * r['mfu']:.1f}% | {split} |")  # fmt: skip


def verdict(published: float, bounds: list[float]) -> str:
    """Where a published figure lies against a predicted interval: inside, or outside by how much of itself."""
    low, high = bounds
    if low <= published <= high:
        return "inside"
    edge = high if published > high else low
    return f"{'above' if published > high else 'below'} by {100 * abs(published / edge - 1):.0f}%"


def print_mfu_intervals(out: Path) -> None:
    """The Frontier study's figures against the intervals of predict_mfu_device.json, under both conventions: the
    model's FLOPs (MFU) and Megatron-DeepSpeed's logged count, which adds the recomputed forward (HFU)."""
    print("| recipe | nodes (devices) | activation checkpointing | predicted step s: fast - likely - slow | "
          "MFU (model FLOPs): low - likely - high | HFU (Megatron's count): low - likely - high | published | "
          "published against the HFU interval | point difference |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in json.loads((out / "predict_mfu_device.json").read_text()):
        (fast, slow), published = r["step_time_s_range"], r["published_mfu"]
        (low, high), (hw_low, hw_high) = r["mfu_range"], r["hfu_range"]
        print(f"| {r['recipe']} | {r['nodes']:g} ({r['world']}) | {r['activation_checkpointing']} | "
              f"{fast:.2f} - {r['step_time_s']:.2f} - {slow:.2f} | "
              f"{100 * low:.1f} - {100 * r['mfu']:.1f} - {100 * high:.1f}% | "
              f"{100 * hw_low:.1f} - {100 * r['hfu']:.1f} - {100 * hw_high:.1f}% | {100 * published:.2f}% | "
              f"{verdict(published, [hw_low, hw_high])} | {100 * (r['hfu'] / published - 1):+.0f}% |")  # fmt: skip


def print_interval_table(out: Path, name: str = "_device") -> None:
    """The recipes' predictions with their intervals (predict_recipes<name>.json), and the published figure where
    a study measured that layout's size, against the HFU interval (the study's count, print_mfu_intervals)."""
    published = {(recipe, nodes): mfu for recipe, nodes, mfu in PUBLISHED_MFU}
    print("| layout | devices | step s: fast - likely - slow | MFU: low - likely - high | HFU: low - likely - high | "
          "published | published against the HFU interval |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in json.loads((out / f"predict_recipes{name}.json").read_text()):
        (fast, slow), (low, high), (hw_low, hw_high) = r["step_time_s_range"], r["mfu_range"], r["hfu_range"]
        mfu = published.get((r["layout"], r["nodes"]))
        against = "- | -" if mfu is None else f"{100 * mfu:.2f}% | {verdict(mfu, [hw_low, hw_high])}"
        print(f"| {r['layout']} | {r['world']} | {fast:.2f} - {r['step_time_s']:.2f} - {slow:.2f} | "
              f"{100 * low:.1f} - {100 * r['mfu']:.1f} - {100 * high:.1f}% | "
              f"{100 * hw_low:.1f} - {100 * r['hfu']:.1f} - {100 * hw_high:.1f}% | {against} |")  # fmt: skip


def print_searched_table(out: Path, name: str = "_searched", before: str = "_device") -> None:
    """The recipes that `optimus plan --search` re-laid (predict_recipes<name>.json) beside their hand-written
    layouts' predictions (predict_recipes<before>.json, kept as they were), each with its interval."""
    earlier = {r["layout"]: r for r in json.loads((out / f"predict_recipes{before}.json").read_text())}
    print("| layout | devices | step s before: fast - likely - slow | step s now | speed-up | MFU before | MFU now | "
          "split now |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in json.loads((out / f"predict_recipes{name}.json").read_text()):
        b = earlier[r["layout"]]
        steps = [f"{row['step_time_s_range'][0]:.2f} - {row['step_time_s']:.2f} - {row['step_time_s_range'][1]:.2f}"
                 for row in (b, r)]  # fmt: skip
        mfus = [f"{100 * row['mfu_range'][0]:.1f} - {100 * row['mfu']:.1f} - {100 * row['mfu_range'][1]:.1f}%"
                for row in (b, r)]  # fmt: skip
        speed_up = b["step_time_s"] / r["step_time_s"]
        print(f"| {r['layout']} | {r['world']} | {steps[0]} | {steps[1]} | {speed_up:.2f}x | {mfus[0]} | {mfus[1]} | "
              f"{_split_cell(r['time_split'], r['step_time_s'])} |")  # fmt: skip


def print_algorithm_table(out: Path, name: str = "_device") -> None:
    """Per recipe, the step with every collective a flat ring against the library's algorithms, which ones its
    collectives take, and the wait for the slowest rank (predict_recipes<name>.json)."""
    print("| layout | library | step s, flat rings | step s, the library's algorithms | change | algorithms taken "
          "(calls of the traced ranks) | stragglers' wait |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in json.loads((out / f"predict_recipes{name}.json").read_text()):
        without, step = r["step_time_s_without"], r["step_time_s"]
        flat, library = without["vendor_algorithms"], r["machine_numbers"]["library"]
        taken = "; ".join(
            f"{op.replace('_', '-')} " + ", ".join(f"{algo} {n}" for algo, n in counts.items())
            for op, counts in r["collective_algorithms"].items()
            if op in ("all_reduce", "all_gather", "reduce_scatter")
        )
        wait = step - without["stragglers"]
        print(f"| {r['layout']} | {library} | {flat:.2f} | {step:.2f} | {100 * (step / flat - 1):+.1f}% | {taken} | "
              f"{wait:.3f} s ({100 * wait / step:.1f}%) |")  # fmt: skip


def print_width_table(out: Path, name: str = "_device") -> None:
    """Per recipe, the three ranged numbers that move its step most alone (predict_recipes<name>.json)."""
    print("| layout | first | second | third |")
    print("|---|---|---|---|")
    for r in json.loads((out / f"predict_recipes{name}.json").read_text()):
        top = sorted(r.get("range_effects", {}).items(), key=lambda kv: kv[1][0] - kv[1][1])[:3]
        cells = [f"{number} {round(100 * fast):+d}% / {round(100 * slow):+d}%" for number, (fast, slow) in top]
        print(f"| {r['layout']} | " + " | ".join(cells) + " |")


def print_scaling_device_table(out: Path) -> None:
    """The published scaling series traced on the device path (predict_scaling_device.json), with each
    efficiency's range over both corners and the point."""
    print("| recipe | nodes (devices) | mode | global batch | predicted step s: fast - likely - slow | MFU | "
          "efficiency (range) | published |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for series in json.loads((out / "predict_scaling_device.json").read_text()):
        for row in series["rows"]:
            for mode in ("strong", "weak"):
                pred = row.get(mode)
                if pred is None or "refused" in pred:
                    continue
                (fast, slow), eff = pred["step_time_s_range"], row.get(f"{mode}_efficiency")
                bounds = row.get(f"{mode}_efficiency_range")
                cell = "-" if eff is None else f"{100 * eff:.1f}% ({100 * bounds[0]:.1f}-{100 * bounds[1]:.1f})"
                published = series["published"].get(mode)
                against = "-" if published is None else f"{100 * published:.0f}%"
                print(f"| {series['recipe']} | {row['nodes']} ({pred['world']:,}) | {mode} | "
                      f"{pred['global_batch']:,} | {fast:.2f} - {pred['step_time_s']:.2f} - {slow:.2f} | "
                      f"{100 * pred['mfu']:.1f}% | {cell} | {against} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["local", "studies", "recipes", "mfu", "scaling", "alltoall", "tables"])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--repeats", type=int, default=3, help="local: how many times to run every layout")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "optimus-predict-traces"))
    parser.add_argument("--device", help="trace every recipe on this device path (default: each recipe's own)")
    parser.add_argument("--name", default="", help="a suffix of the results' files (predict_recipes<NAME>.json)")
    parser.add_argument(
        "--only", nargs="+", help="recipes: these layouts of dry_run.py's LAYOUTS; scaling: these recipes' series"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "local":
        run_local(out, args.repeats)
    elif args.what == "tables":
        print_tables(out)
        print()
        print_mfu_intervals(out)
        print()
        print_interval_table(out)
        print()
        print_width_table(out)
        print()
        print_algorithm_table(out)
        if (out / "predict_recipes_searched.json").exists():
            print()
            print_searched_table(out)
            print()
            print_width_table(out, "_searched")
        print()
        print_scaling_device_table(out)
        print()
        print_all_to_all_table(out)
    elif args.what == "recipes":
        run_recipes(out, Path(args.cache), args.device, args.name, args.only)
    elif args.what == "mfu":
        run_mfu(out, Path(args.cache))
    elif args.what == "alltoall":
        run_all_to_all(out, Path(args.cache))
    elif args.what == "scaling":
        run_scaling(out, Path(args.cache), args.only)
    else:
        run_studies(out, Path(args.cache))


if __name__ == "__main__":
    main()
