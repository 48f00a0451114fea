"""Writing a scaling report: report.json, report.csv, report.md, PNG plots, and the console table."""

from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path

from optimus.report.plots import plot_breakdown, plot_efficiency, plot_throughput
from optimus.report.runs import ReportError
from optimus.report.summary import layout_label, phase_order

COLUMNS = (
    "run", "devices", "pp", "tp", "dp", "ep", "edp", "global_batch", "steps_measured", "tokens_per_s",
    "tokens_per_s_per_device", "tflops_per_device", "mfu", "step_time_mean_s", "step_time_std_s", "step_time_p50_s",
    "step_time_p90_s", "speedup", "efficiency", "shared_cores",
)  # fmt: skip
PREDICTED_COLUMNS = ("predicted_step_s", "predicted_error", "predicted_efficiency")  # with --predict
REPORT_FILES = ("report.md", "report.csv", "report.json", "efficiency.png", "throughput.png", "breakdown.png")


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _efficiency_cell(row: dict) -> str:
    if row["efficiency"] is not None:
        return f"{100 * row['efficiency']:.1f}%"
    return "shared cores" if row["shared_cores"] else "- (base shared cores)"


def shared_core_notes(rows: list[dict]) -> list[str]:
    """One sentence per run whose ranks shared cores (summary.add_efficiency gives no efficiency there)."""
    return [
        f"{r['run']}: {r['shared_cores']}, so its step times measure contention, not scaling (no efficiency given): "
        "rerun it with fewer ranks per host, or fewer threads per rank (OMP_NUM_THREADS)."
        for r in rows
        if r["shared_cores"]
    ]


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the summary table that the console and report.md show."""
    header = ["devices", "layout", "batch", "tokens/s", "tok/s/dev", "TFLOP/s/dev", "MFU %", "step ms (std)",
              "p50 / p90 ms", "speedup", "efficiency"]  # fmt: skip
    cells = []
    for r in rows:
        cells.append([
            str(r["devices"]), layout_label(r), str(r["global_batch"]), f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s_per_device']:,.0f}", _fmt(r["tflops_per_device"]),
            _fmt(None if r["mfu"] is None else 100 * r["mfu"]),
            f"{1e3 * r['step_time_mean_s']:.1f} ({1e3 * r['step_time_std_s']:.1f})",
            f"{1e3 * r['step_time_p50_s']:.1f} / {1e3 * r['step_time_p90_s']:.1f}",
            _fmt(r["speedup"]), _efficiency_cell(r),
        ])  # fmt: skip
    if rows and "predicted_step_s" in rows[0]:
        header += ["predicted step ms (interval)", "measured vs predicted", "predicted efficiency"]
        for r, row_cells in zip(rows, cells):
            step = _scaled(r["predicted_step_s"], 1e3, ".1f")
            if r.get("predicted_step_s_range"):
                step += " ({:.1f}-{:.1f})".format(*(1e3 * s for s in r["predicted_step_s_range"]))
            row_cells += [step, _scaled(r["predicted_error"], 100, "+.1f", "%"),
                          _scaled(r["predicted_efficiency"], 100, ".1f", "%")]  # fmt: skip
    return header, cells


def _scaled(value: float | None, factor: float, spec: str, unit: str = "") -> str:
    """`value` x `factor` formatted, or `-` for a run without it (no prediction)."""
    return "-" if value is None else f"{factor * value:{spec}}{unit}"


def breakdown_table(rows: list[dict]) -> tuple[list[str], list[list[str]]] | None:
    phases = phase_order(rows)
    if not phases:
        return None
    header = ["devices", "layout", *phases, "step"]
    cells = [
        [str(r["devices"]), layout_label(r)]
        + [f"{1e3 * r['breakdown_s'][p]:.1f}" if p in r["breakdown_s"] else "-" for p in phases]
        + [f"{1e3 * r['step_time_mean_s']:.1f}"]
        for r in rows
    ]
    return header, cells


def _markdown_table(header: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


METHOD = """Method: steps after warm-up only. tokens/s = tokens per step x steps / total step time;
TFLOP/s per device = tokens/s x flops_per_token / devices (6 x active matmul parameters + attention);
MFU = that / the device's peak (run_info.json; on CPU a matmul probe). Weak efficiency = tokens/s per
device / that of the smallest run; strong efficiency = (T_1 x N_1) / (T_N x N), T = mean step time.
The breakdown (profile.timers=true) is rank 0's exclusive time per phase, with the device synchronised
at each phase boundary; communication inside the autograd backward counts as backward; `other` is the
rest of the step (loss reductions for logging, Python). With --predict: the step time `optimus plan
--predict` gives for each run's config and world size, and the efficiency those predicted times give."""


def write_markdown(rows: list[dict], mode: str, warmup: int, notes: list[str], plots: list[str], path: Path) -> None:
    devices = sorted({r["device"] for r in rows})
    parts = [f"# {mode.capitalize()} scaling report", ""]
    parts += [f"- {n}" for n in notes] + [f"- Device: {', '.join(devices)}", f"- Warm-up steps dropped: {warmup}"]
    parts += [f"- Ranks shared cores: {n}" for n in shared_core_notes(rows)]
    parts += [f"- No prediction for {r['run']}: {r['predicted_refused']}" for r in rows if "predicted_refused" in r]
    parts += [""]
    parts += [_markdown_table(*table_rows(rows)), ""]
    bd = breakdown_table(rows)
    if bd is not None:
        parts += ["## Step-time breakdown (ms per step, rank 0)", "", _markdown_table(*bd), ""]
    parts += [f"![{Path(p).stem}]({p})" for p in plots] + ["", METHOD, "", "Runs:", ""]
    parts += [f"- {r['devices']} devices: `{r['path']}`" for r in rows]
    path.write_text("\n".join(parts) + "\n")


def write_csv(rows: list[dict], path: Path) -> None:
    phases = phase_order(rows)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        predicted = [c for c in PREDICTED_COLUMNS if rows and c in rows[0]]
        writer.writerow([*COLUMNS, *predicted, *(f"time_{p}_s" for p in phases)])
        for r in rows:
            writer.writerow([r[c] for c in (*COLUMNS, *predicted)] + [r["breakdown_s"].get(p) for p in phases])


def print_table(rows: list[dict], mode: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: plain text
        header, cells = table_rows(rows)
        print("\t".join(header))
        for row in cells:
            print("\t".join(row))
        return
    for title, table in ((f"{mode} scaling", table_rows(rows)), ("step-time breakdown, ms", breakdown_table(rows))):
        if table is None:
            continue
        t = Table(title=title)
        for name in table[0]:
            t.add_column(name, justify="right")
        for row in table[1]:
            t.add_row(*row)
        console = Console()
        console.width = max(console.width, 150)  # a narrow pipe would fold the columns
        console.print(t)


def check_out(out: Path, overwrite: bool) -> None:
    """--out is a directory that holds no earlier report, unless --overwrite asks to replace it."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file, not a directory: choose another --out.")
    earlier = [name for name in REPORT_FILES if (out / name).exists()]
    if earlier and not overwrite:
        raise ReportError(
            f"--out {out} already holds a report ({', '.join(earlier)}): choose another --out, or pass --overwrite "
            "to replace it."
        )


def write_report(rows: list[dict], mode: str, warmup: int, notes: list[str], out: Path) -> list[Path]:
    """Write every output of the report into a new directory beside `out`, then move them into `out` (made if
    missing; other files there stay), replacing an earlier report's files and removing those this one lacks;
    returns the paths written. check_out has refused an `out` whose report may not be replaced."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.TemporaryDirectory(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as err:
        raise ReportError(f"--out {out} cannot be made a directory ({err.strerror}): choose another --out.") from None
    with staging as tmp:
        written = _write_files(rows, mode, warmup, notes, Path(tmp))
        out.mkdir(exist_ok=True)
        for name in REPORT_FILES:
            if name in written:
                os.replace(Path(tmp) / name, out / name)
            else:  # an earlier report's plot that this one has no data for
                (out / name).unlink(missing_ok=True)
    return [out / name for name in written]


def _write_files(rows: list[dict], mode: str, warmup: int, notes: list[str], out: Path) -> list[str]:
    plots = ["efficiency.png", "throughput.png"]
    plot_efficiency(rows, mode, out / plots[0])
    plot_throughput(rows, out / plots[1])
    if plot_breakdown(rows, out / "breakdown.png"):
        plots.append("breakdown.png")
    payload = {"mode": mode, "warmup_steps": warmup, "notes": notes, "runs": rows}
    (out / "report.json").write_text(json.dumps(payload, indent=2) + "\n")
    write_csv(rows, out / "report.csv")
    write_markdown(rows, mode, warmup, notes, plots, out / "report.md")
    return ["report.md", "report.csv", "report.json", *plots]
