"""`optimus report RUN_DIR... --out DIR`: its options. The report itself is optimus.report.build."""

from __future__ import annotations

import argparse
from pathlib import Path

from optimus.report.build import build_report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="optimus report",
        description="Throughput, MFU, step-time statistics and scaling efficiency of a series of runs of one "
        "experiment on different device counts; writes report.md/.csv/.json and PNG plots into --out.",
    )
    p.add_argument("runs", nargs="+", help="run directories (each holds config.yaml, run_info.json, metrics.jsonl)")
    p.add_argument("--out", required=True, help="directory for the report")
    p.add_argument(
        "--mode",
        choices=("auto", "weak", "strong"),
        default="auto",
        help="weak: batch per device fixed; strong: global batch fixed (auto: strong if all global batches agree)",
    )
    p.add_argument("--warmup-steps", type=int, default=2, help="steps dropped from the start of each run (default 2)")
    p.add_argument("--note", action="append", default=[], help="a line for the report's header (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier report in --out (refused by default)")
    p.add_argument(
        "--predict",
        action="store_true",
        help="put the performance model's step time beside each run's (optimus plan --predict)",
    )
    return p


def main(argv: list[str]) -> int:
    opts = _parser().parse_args(argv)
    build_report(opts.runs, opts.out, opts.mode, opts.warmup_steps, opts.note, opts.overwrite, opts.predict)
    print(f"report written to {Path(opts.out) / 'report.md'}")
    return 0
