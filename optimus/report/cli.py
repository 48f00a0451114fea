"""`optimus report RUN_DIR... --out DIR`: the scaling-efficiency report of a series of runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from optimus.report.compare import check_comparable, infer_mode
from optimus.report.runs import ReportError, load_run
from optimus.report.summary import add_efficiency, summarize_run
from optimus.report.write import check_out, print_table, shared_core_notes, write_report


def build_report(
    run_dirs: list[str | Path],
    out: str | Path,
    mode: str = "auto",
    warmup_steps: int = 2,
    notes=(),
    overwrite: bool = False,
    predict: bool = False,
) -> list[dict]:
    """Read, check, summarise and write; returns the per-run rows (sorted by device count). An earlier report
    in `out` is replaced only with `overwrite`."""
    check_out(Path(out), overwrite)
    if not run_dirs:
        raise ReportError("no run directories given: pass one or more run.dir paths written by `optimus train`.")
    if warmup_steps < 0:
        raise ReportError(f"--warmup-steps {warmup_steps} must be 0 or more.")
    runs = [load_run(p) for p in distinct(run_dirs)]
    mode = infer_mode(runs) if mode == "auto" else mode
    check_comparable(runs, mode)
    summaries = []
    for run in runs:
        row = summarize_run(run, warmup_steps)
        row["device"] = run.device_name
        summaries.append(row)
    rows = add_efficiency(summaries, mode)
    if predict:
        from optimus.report.predicted import add_predictions

        add_predictions(rows, {str(run.path): run for run in runs}, mode)
    write_report(rows, mode, warmup_steps, list(notes), Path(out))
    print_table(rows, mode)
    for note in shared_core_notes(rows):
        print(f"Ranks shared cores: {note}")
    return rows


def distinct(run_dirs: list[str | Path], log=print) -> list[Path]:
    """The run directories, each once: one named twice (or by two paths) would be a second row and a second point
    of every plot, a scaling series of one run with itself. Each repeat is named and dropped."""
    first: dict[Path, Path] = {}
    for path in map(Path, run_dirs):
        if path.resolve() in first:
            log(f"{path} is the run {first[path.resolve()]} given again: it is reported once.")
        else:
            first[path.resolve()] = path
    return list(first.values())


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
