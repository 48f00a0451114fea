"""The scaling-efficiency report of a series of runs, built from their directories (`optimus report`)."""

from __future__ import annotations

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
