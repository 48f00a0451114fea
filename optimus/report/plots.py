"""PNG plots of a scaling report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from optimus.report.summary import layout_label, phase_order  # noqa: E402


def _label(row: dict) -> str:
    return f"{row['devices']}\n({layout_label(row)})"


def plot_efficiency(rows: list[dict], mode: str, path: Path) -> None:
    """Efficiency vs devices, for the runs that have one (none where ranks shared cores)."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    devices = [r["devices"] for r in rows]
    measured = [r for r in rows if r["efficiency"] is not None]
    if measured:
        ax.plot([r["devices"] for r in measured], [r["efficiency"] for r in measured], "o-", label="measured")
    else:  # the base run's ranks shared cores: nothing to plot but the axes
        ax.set_xlim(min(devices) / 1.5, max(devices) * 1.5)
    # With --predict: the runs it could predict.
    predicted = [r for r in rows if r.get("predicted_efficiency") is not None]
    if predicted:
        ax.plot(
            [r["devices"] for r in predicted], [r["predicted_efficiency"] for r in predicted], "s--", label="predicted"
        )
    ax.axhline(1.0, color="gray", linestyle="--", label="ideal")
    ax.set_xscale("log", base=2)
    ax.set_xticks(devices, [str(d) for d in devices])
    ax.set_ylim(
        0, 1.1 * max([1.0] + [r["efficiency"] for r in measured] + [r["predicted_efficiency"] for r in predicted])
    )
    ax.set_xlabel("devices")
    ax.set_ylabel(f"{mode} scaling efficiency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(rows: list[dict], path: Path) -> None:
    """tokens/s vs devices, with the ideal line (the smallest run's tokens/s per device times the devices)."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    devices = [r["devices"] for r in rows]
    base = rows[0]["tokens_per_s_per_device"]
    ax.plot(devices, [r["tokens_per_s"] for r in rows], "o-", label="measured")
    ax.plot(devices, [base * d for d in devices], "--", color="gray", label="ideal (linear)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(devices, [str(d) for d in devices])
    ax.set_xlabel("devices")
    ax.set_ylabel("tokens/s (all devices)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_breakdown(rows: list[dict], path: Path) -> bool:
    """Stacked mean step time per phase, one bar per run; False (no file) when no run has timers."""
    phases = phase_order(rows)
    if not phases:
        return False
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(rows), 4))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for phase in phases:
        ms = [1e3 * r["breakdown_s"].get(phase, 0.0) for r in rows]
        ax.bar(x, ms, bottom=bottom, label=phase)
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set_xticks(list(x), [_label(r) for r in rows])
    ax.set_xlabel("devices")
    ax.set_ylabel("ms per step (rank 0)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
