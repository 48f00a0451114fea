"""A real step's operators, as the step runs them, against the performance model's view of the same step.

    python benchmarks/step_operators.py [--nproc N] [--name NAME] [--out benchmarks/results] [OVERRIDE ...]

Runs `optimus train` on this machine (the default model, AdamW, 8 steps) with `profile.operators` over steps
4-6: rank 0's every operator timed inside the step (optimus/train/operator_times.py), by signature. Then, as
`machine=local` would for a prediction of the same layout: the step traced at the run's world size and its mean
expert-load imbalance, and each distinct operator of the run and of the trace replayed alone on fresh inputs by
as many processes at once as the run has ranks, each with a rank's threads. Three totals of rank 0's operators
per step answer two questions:

- in the step, against the same signatures replayed: does an operator cost what it costs alone?
- the trace priced by the replay, against the step: does the trace hold the operators the step runs?

Writes step_operators_<NAME>.json and .md (NAME: cpu1 for one process, cpu<N> for N): the totals, and the
operators with the largest differences, by signature (in the step against alone) and by operator name (calls
and seconds in the step against the trace's). The step times of the same run without the timing (steps 7-8)
are beside them. Shares this machine's cores with nothing else; its numbers are this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from memory import ADAMW, machine_meta  # noqa: E402  benchmarks/ is first on sys.path

STEPS, WINDOW, UNTIMED = 8, "4-6", (7, 8)  # the timed window, and later steps that run without the timing


def run_with_operator_times(nproc: int, overrides: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "optimus", "train", f"parallel.nproc={nproc}", f"train.steps={STEPS}",
           "train.log_interval=1", "train.eval_interval=1000", "profile.operators=true",
           f"profile.torch_steps={WINDOW}", f"run.dir={run_dir}", *ADAMW, *overrides]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steps = [r for r in records if "step_time_s" in r]
    return {
        "operators": json.loads((run_dir / "operators" / "rank0.json").read_text()),
        "untimed_step_s": [r["step_time_s"] for r in steps if r["step"] in UNTIMED],
        "imbalance": statistics.mean(r["expert_load_imbalance"] for r in steps),
    }


def name_of(signature: str) -> str:
    return json.loads(signature)[0] if signature.startswith("[") else signature


def compare(nproc: int, overrides: list[str]) -> dict:
    from optimus.perf.machine import measure_local, timed_by_every_rank
    from optimus.perf.op_timing import traced_signatures
    from optimus.perf.predict import trace_step
    from optimus.recipes import load_config

    with tempfile.TemporaryDirectory() as tmp:
        run = run_with_operator_times(nproc, overrides, Path(tmp) / "run")
    in_step = run["operators"]["operators"]  # signature -> [calls, seconds] per step
    cfg = load_config([f"parallel.nproc={nproc}", *ADAMW, *overrides])
    traces = trace_step(cfg, nproc, run["imbalance"], progress="none")
    traced = Counter()
    for event in traces[0]["events"]:
        if event["e"] == "ops":
            for kind, _, _, _, sig, count in event["ops"]:
                if kind != "view" and sig is not None:
                    traced[sig] += count
    replayable = sorted({s for s in in_step if s.startswith("[")} | set(traced_signatures(traces)))
    alone = timed_by_every_rank(replayable, measure_local(nproc).op_threads, nproc)
    return {"run": run, "in_step": in_step, "traced": dict(traced), "alone": alone}


def summary(result: dict) -> dict:
    in_step, traced, alone = result["in_step"], result["traced"], result["alone"]
    same = [s for s in in_step if s in alone]
    by_name: dict[str, list[float]] = {}
    for sig, (calls, seconds) in in_step.items():
        row = by_name.setdefault(name_of(sig), [0.0, 0.0, 0.0, 0.0])
        row[0] += calls
        row[1] += seconds
    for sig, calls in traced.items():
        row = by_name.setdefault(name_of(sig), [0.0, 0.0, 0.0, 0.0])
        row[2] += calls
        row[3] += calls * alone.get(sig, 0.0)
    slower = sorted(same, key=lambda s: in_step[s][1] - in_step[s][0] * alone[s], reverse=True)
    return {
        "in_step_s": sum(seconds for _, seconds in in_step.values()),
        "same_in_step_s": sum(in_step[s][1] for s in same),
        "same_alone_s": sum(in_step[s][0] * alone[s] for s in same),
        "trace_alone_s": sum(calls * alone.get(sig, 0.0) for sig, calls in traced.items()),
        "trace_untimed": sum(calls for sig, calls in traced.items() if sig not in alone),
        "timed_wall_s": result["run"]["operators"]["step_wall_s"],
        "untimed_step_s": result["run"]["untimed_step_s"],
        "slower_in_step": [[s, *in_step[s], in_step[s][0] * alone[s]] for s in slower[:12]],
        "by_name": sorted(([n, *v] for n, v in by_name.items()), key=lambda r: -abs(r[2] - r[4]))[:20],
    }


def markdown(meta: dict, nproc: int, overrides: list[str], s: dict) -> str:
    ms = 1e3
    lines = [
        f"# A real step's operators against the model's view of them ({nproc} process{'es' if nproc > 1 else ''})",
        "",
        f"`{meta['command']}`, {meta['date']}. Machine: {meta['cores']} CPUs ({meta['cpu_flags']}), torch "
        f"{meta['torch']}. Layout: {' '.join(overrides) or 'the default run'}, AdamW. Rank 0, per step, steps "
        f"{WINDOW} (module docstring).",
        "",
        "| | seconds per step |",
        "|---|---|",
        f"| the step without the timing (steps {UNTIMED[0]}-{UNTIMED[1]}) | "
        + ", ".join(f"{t:.3f}" for t in s["untimed_step_s"]) + " |",
        "| the step with every operator timed | " + ", ".join(f"{t:.3f}" for t in s["timed_wall_s"]) + " |",
        f"| its operators, in the step | {s['in_step_s']:.3f} |",
        f"| those that replay, in the step | {s['same_in_step_s']:.3f} |",
        f"| the same, each alone (machine=local's timing) | {s['same_alone_s']:.3f} |",
        f"| the traced step's operators, each alone ({s['trace_untimed']} calls that do not replay left out) | "
        f"{s['trace_alone_s']:.3f} |",
        "",
        "Slower in the step than alone, by signature (ms per step):",
        "",
        "| signature | calls | in the step | alone |",
        "|---|---|---|---|",
    ]  # fmt: skip
    for sig, calls, seconds, alone in s["slower_in_step"]:
        lines.append(f"| `{sig[:140]}` | {calls:.0f} | {seconds * ms:.2f} | {alone * ms:.2f} |")
    lines += ["", "The step against its trace, by operator (ms per step; the trace's priced alone):", "",
              "| operator | calls in the step | in the step | calls in the trace | the trace's, alone |",
              "|---|---|---|---|---|"]  # fmt: skip
    for name, calls, seconds, traced_calls, traced_s in s["by_name"]:
        lines.append(f"| `{name}` | {calls:.0f} | {seconds * ms:.2f} | {traced_calls:.0f} | {traced_s * ms:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--name", help="results file suffix (default cpu<nproc>)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("overrides", nargs="*")
    opts = parser.parse_args()
    meta = machine_meta("step_operators.py")
    result = compare(opts.nproc, opts.overrides)
    s = summary(result)
    name = opts.name or f"cpu{opts.nproc}"
    (opts.out / f"step_operators_{name}.json").write_text(json.dumps({"meta": meta, "summary": s}, indent=1))
    (opts.out / f"step_operators_{name}.md").write_text(markdown(meta, opts.nproc, opts.overrides, s))
    print(markdown(meta, opts.nproc, opts.overrides, s))


if __name__ == "__main__":
    main()
