"""The data-parallel collectives of a real gloo run, in its profile, beside the prediction of the same layout.

    python benchmarks/overlap.py [--out benchmarks/results] [--steps 4] [OVERRIDE ...]

Runs `optimus train` of the tiny model on 4 gloo processes at ep 2 x dp 2 (dense data parallel 4, expert data
parallel 2) under ZeRO-2, with one step profiled (`profile.torch`), and reads every rank's trace: each
collective the main thread issues (`c10d::...`) is paired with the gloo work that ran it on a gloo thread
(`gloo:...`, in issue order), and classed by the profiler range Optimus opens around it
(optimus.optim.shard_group: `optimus.grad_reduce` for a gradient bucket's reduction, `optimus.param_gather` for
a parameter bucket's gather; anything else is the step's other collectives: the expert exchange, the norm).
For each data-parallel collective: how long gloo ran it, how much of that the main thread spent blocked on it
(inside the range's `.wait`: exposed), the rest hidden behind the step's work, and, for a gradient reduction,
whether it was issued before the backward's last operator (as the backward produced its bucket). Beside it,
`optimus plan --predict` of the same layout on machine=local: the data-parallel collectives' time the replay
prices and the part of it exposed (`exposed_data_parallel`). Writes overlap_cpu.json and overlap_cpu.md.
The 4 processes share this machine's cores, so gloo's threads compete with the computing ones: the times are
this machine's, the structure (what runs beside what) is the code's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from memory import machine_meta  # noqa: E402  benchmarks/ is first on sys.path

from optimus.optim.shard_group import GRAD_REDUCE, GRAD_REDUCE_WAIT, PARAM_GATHER, PARAM_GATHER_WAIT  # noqa: E402

LAYOUT = ["model=tiny", "parallel.nproc=4", "parallel.ep=2", "optim.zero=2", "optim.update=adamw",
          "train.global_batch=32", "optim.bucket_mb=2"]  # fmt: skip
KINDS = {GRAD_REDUCE: ("gradient reductions", GRAD_REDUCE_WAIT), PARAM_GATHER: ("parameter gathers", PARAM_GATHER_WAIT)}


def _overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    """Microseconds of [a0, a1] covered by the (disjoint) spans."""
    return sum(max(0.0, min(a[1], b[1]) - max(a[0], b[0])) for b in spans)


def rank_collectives(trace_file: Path) -> dict:
    """One rank's profiled step: each data-parallel collective's gloo time, exposed and hidden part (us)."""
    events = [e for e in json.loads(trace_file.read_text())["traceEvents"] if e.get("ph") == "X"]
    main = max({e["tid"] for e in events}, key=lambda tid: sum(e["tid"] == tid for e in events))  # the busiest
    on_main = [e for e in events if e["tid"] == main]
    issued = sorted((e for e in on_main if e["name"].startswith("c10d::")), key=lambda e: e["ts"])
    run = sorted((e for e in events if e["name"].startswith("gloo:") and e["tid"] != main), key=lambda e: e["ts"])
    if len(issued) != len(run):
        raise SystemExit(f"{trace_file}: {len(issued)} collectives issued, {len(run)} run by gloo: cannot pair them")
    ranges = {name: [(e["ts"], e["ts"] + e["dur"]) for e in on_main if e["name"] == name] for name in
              (GRAD_REDUCE, GRAD_REDUCE_WAIT, PARAM_GATHER, PARAM_GATHER_WAIT)}  # fmt: skip
    backward = [e["ts"] + e["dur"] for e in on_main if e["name"].startswith("autograd::engine::evaluate_function")]
    backward_end = max(backward) if backward else float("inf")
    out = {label: {"count": 0, "gloo_us": 0.0, "exposed_us": 0.0, "issued_in_backward": 0} for label, _ in
           KINDS.values()}  # fmt: skip
    for call, work in zip(issued, run):
        kind = next((k for k in KINDS if _overlap((call["ts"], call["ts"] + call["dur"]), ranges[k])), None)
        if kind is None:
            continue  # the expert exchange, the gradient norm's all-reduce: not the optimizer's collectives
        label, wait = KINDS[kind]
        span = (work["ts"], work["ts"] + work["dur"])
        row = out[label]
        row["count"] += 1
        row["gloo_us"] += work["dur"]
        row["exposed_us"] += _overlap(span, ranges[wait])
        row["issued_in_backward"] += call["ts"] < backward_end
    return out


def measured(steps: int, overrides: list[str]) -> dict:
    """The profiled run's data-parallel collectives, per rank and their mean."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "optimus", "train", *LAYOUT, *overrides, f"train.steps={steps}",
                   "train.log_interval=1", "train.eval_interval=100000", "profile.torch=true",
                   f"profile.torch_steps={steps - 1}-{steps - 1}", f"run.dir={tmp}/run"]  # fmt: skip
        print(" ".join(command[2:]), flush=True)
        subprocess.run(command, check=True, cwd=REPO, capture_output=True)
        ranks = [rank_collectives(path) for path in sorted(Path(tmp, "run").glob("trace_rank*.json"))]
    mean = {
        label: {key: statistics.mean(r[label][key] for r in ranks) for key in ranks[0][label]} for label in ranks[0]
    }
    return {"ranks": ranks, "mean": mean}


def predicted(overrides: list[str]) -> dict:
    """`optimus plan --predict` of the layout on machine=local: its data-parallel collectives' priced time (the
    replay of rank 0's trace) and the part exposed."""
    from optimus.perf.costs import collective_time
    from optimus.perf.machine import machine_model, with_timed_ops
    from optimus.perf.predict import prediction_of, trace_step
    from optimus.perf.replay import comm_kind
    from optimus.recipes import load_config

    cfg = load_config([o for o in [*LAYOUT, *overrides] if not o.startswith("parallel.nproc")])
    world = 4
    traces = trace_step(cfg, world, progress="none")
    machine = with_timed_ops(machine_model(cfg.machine, world), traces)
    prediction = prediction_of(cfg, world, machine, traces)
    priced = {True: 0.0, False: 0.0}  # asynchronous, synchronous (waited for where issued: all of it exposed)
    for event in traces[0]["events"]:
        if event["e"] == "comm" and comm_kind(event["call"], cfg.parallel.tp) == "data_parallel":
            call = {**event["call"], "op": event["as"]} if "as" in event else event["call"]
            priced[event["async"]] += collective_time(machine, call, 0)
    exposed = prediction.time_split.get("exposed_data_parallel", 0.0) - priced[False]
    return {"step_s": prediction.step_time_s, "async_data_parallel_s": priced[True], "exposed_async_s": exposed}


def markdown(result: dict) -> str:
    m, p = result["measured"]["mean"], result["predicted"]
    lines = [
        "# Data-parallel collectives hidden behind the step: a gloo run's profile and the prediction",
        "",
        f"`python benchmarks/overlap.py` ({result['meta']['date']}): `optimus train {' '.join(LAYOUT)}`, step "
        f"{result['steps'] - 1} of {result['steps']} profiled; 4 gloo processes on {result['meta']['cores']} cores "
        f"({result['meta']['cpu_flags']}), torch {result['meta']['torch']}. Per rank, the mean of the 4 ranks.",
        "",
        "| measured (profile) | count | gloo ran them, ms | main thread blocked on them, ms | hidden | issued "
        "during the backward |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, row in m.items():
        hidden = 1 - row["exposed_us"] / row["gloo_us"] if row["gloo_us"] else 0.0
        lines.append(
            f"| {label} | {row['count']:.0f} | {row['gloo_us'] / 1e3:.1f} | {row['exposed_us'] / 1e3:.1f} | "
            f"{hidden:.0%} | {row['issued_in_backward']:.0f} of {row['count']:.0f} |"
        )
    hidden = 1 - p["exposed_async_s"] / p["async_data_parallel_s"] if p["async_data_parallel_s"] else 0.0
    total = {key: sum(row[key] for row in m.values()) for key in ("gloo_us", "exposed_us")}
    lines += [
        "",
        f"Measured, both kinds: {total['gloo_us'] / 1e3:.1f} ms of gloo work, {total['exposed_us'] / 1e3:.1f} ms "
        f"of it exposed ({1 - total['exposed_us'] / total['gloo_us']:.0%} hidden). Predicted (`optimus plan "
        f"--predict --world 4` of the same layout, machine=local, rank 0's replay): the same asynchronous "
        f"collectives priced at {p['async_data_parallel_s'] * 1e3:.1f} ms, {p['exposed_async_s'] * 1e3:.1f} ms of "
        f"them exposed ({hidden:.0%} hidden); step {p['step_s']:.3f} s.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--steps", type=int, default=4, help="steps of the run; the last but one is profiled")
    parser.add_argument("overrides", nargs="*", help="more overrides for the run and the prediction")
    args = parser.parse_args()
    result = {"meta": machine_meta("overlap.py"), "layout": LAYOUT + args.overrides, "steps": args.steps}
    result["measured"] = measured(args.steps, args.overrides)
    result["predicted"] = predicted(args.overrides)
    (args.out / "overlap_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "overlap_cpu.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
