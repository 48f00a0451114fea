"""Reading a run directory: the resolved config, the run's facts and the per-step metrics.

    optimus train train.steps=20 run.dir=runs/demo
    python examples/read_run_metrics.py runs/demo

`optimus.report.load_run` reads config.yaml, run_info.json and metrics.jsonl (one JSON object per
optimizer step) and says in one sentence which file is missing or broken; `summarize_run` is what
`optimus report` computes per run (throughput, MFU, step-time percentiles).
"""

from __future__ import annotations

import argparse
import sys

from optimus.report import ReportError, load_run, summarize_run


def describe(run_dir: str) -> dict:
    """The facts this example prints, as a dict (the test compares them with the files themselves)."""
    run = load_run(run_dir)
    losses = [r["loss"] for r in run.records]
    evaluations = [(r["step"], r["val_loss"]) for r in run.records if "val_loss" in r]
    summary = summarize_run(run, warmup_steps=1) if len(run.records) > 1 else None
    return {
        "model": run.config["model"]["name"],
        "params_total": run.info["params"]["total"],
        "layout": run.info["layout"],
        "steps": len(run.records),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "evaluations": evaluations,
        "tokens_per_s": summary["tokens_per_s"] if summary else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    try:
        facts = describe(args.run_dir)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    layout = facts["layout"]
    params_m = facts["params_total"] / 1e6
    print(f"{facts['model']}: {params_m:.2f}M parameters, world {layout['world']} (EP {layout['ep']})")
    print(f"{facts['steps']} steps: loss {facts['first_loss']:.4f} -> {facts['last_loss']:.4f}")
    for step, val_loss in facts["evaluations"]:
        print(f"  step {step:>5}: val_loss {val_loss:.4f}")
    if facts["tokens_per_s"] is not None:
        print(f"throughput after the first step: {facts['tokens_per_s']:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
