"""The arithmetic of the scaling report: per-run throughput and step-time statistics, then efficiency.

Per run (over the steps after warm-up; n steps, step times t_i, N devices):
    tokens/s             = tokens_per_step * n / sum(t_i)      (total work over total time)
    tokens/s per device  = tokens/s / N
    TFLOP/s per device   = tokens/s * flops_per_token / N / 1e12
    MFU                  = TFLOP/s per device * 1e12 / peak FLOP/s of one device (run_info.json)
    step time            = mean, sample standard deviation, p50 and p90 (linear interpolation)
    breakdown            = mean seconds per step of each timed phase (profile.timers=true);
                           `other` = mean step time - their sum (logging reductions, Python, ...)
Across runs (base = the run with the fewest devices):
    weak   efficiency = (tokens/s per device) / (tokens/s per device of the base)
    strong speedup    = T_base / T_N            efficiency = (T_base * N_base) / (T_N * N)
with T the mean step time.
"""

from __future__ import annotations

import math

from optimus.efficiency import strong_efficiency, weak_efficiency
from optimus.report.runs import Run, measured_records, shared_cores, step_time
from optimus.train.timers import PHASES, phase_key


def percentile(values: list[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between the closest ranks."""
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def sample_std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def breakdown(records: list[dict], mean_step: float) -> dict[str, float]:
    """Mean seconds per step of each phase that any record timed, plus `other`; {} without timers."""
    timed = [p for p in PHASES if any(phase_key(p) in r for r in records)]
    extra = sorted(
        {k for r in records for k in r if k.startswith("time_") and k.endswith("_s")} - set(map(phase_key, PHASES))
    )
    names = timed + [k[len("time_") : -len("_s")] for k in extra]
    if not names:
        return {}
    out = {name: sum(float(r.get(phase_key(name)) or 0.0) for r in records) / len(records) for name in names}
    out["other"] = max(0.0, mean_step - sum(out.values()))
    return out


def layout_label(row: dict) -> str:
    """A run's layout for tables and plots, e.g. `dp2 ep2`; pp and tp are named only where they exceed 1."""
    parts = [f"{dim}{row[dim]}" for dim in ("pp", "tp") if row[dim] > 1]
    return " ".join([*parts, f"dp{row['dp']}", f"ep{row['ep']}"])


def summarize_run(run: Run, warmup_steps: int) -> dict:
    records = measured_records(run, warmup_steps)
    times = [step_time(r, run.tokens_per_step) for r in records]
    tokens_per_s = run.tokens_per_step * len(times) / sum(times)
    flops_per_device = tokens_per_s * run.flops_per_token / run.world
    mean_step = sum(times) / len(times)
    return {
        "run": run.name,
        "path": str(run.path),
        "devices": run.world,
        "pp": run.pp,
        "tp": run.tp,
        "dp": run.dp,
        "ep": run.ep,
        "edp": run.edp,
        "global_batch": run.global_batch,
        "tokens_per_step": run.tokens_per_step,
        "steps_measured": len(times),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / run.world,
        "tflops_per_device": flops_per_device / 1e12,
        "mfu": flops_per_device / run.peak_flops if run.peak_flops else None,
        "step_time_mean_s": mean_step,
        "step_time_std_s": sample_std(times),
        "step_time_p50_s": percentile(times, 50),
        "step_time_p90_s": percentile(times, 90),
        "breakdown_s": breakdown(records, mean_step),
        "shared_cores": shared_cores(run),
    }


def phase_order(rows: list[dict]) -> list[str]:
    """Phases that any row timed, in the order a step runs them; unknown phases after, `other` last."""
    seen = {p for r in rows for p in r["breakdown_s"]}
    known = [p for p in PHASES if p in seen]
    return known + sorted(seen - set(known) - {"other"}) + (["other"] if "other" in seen else [])


def add_efficiency(summaries: list[dict], mode: str) -> list[dict]:
    """Sort by device count and add `efficiency` (and `speedup` for strong scaling) relative to the smallest run;
    None where that run or this one ran its ranks on shared cores (the ratio would measure the contention: a
    starved run makes every other look super-linear)."""
    rows = sorted(summaries, key=lambda s: (s["devices"], s["ep"]))
    base = rows[0]
    for row in rows:
        if row["shared_cores"] or base["shared_cores"]:
            row["efficiency"] = row["speedup"] = None
        elif mode == "weak":
            row["efficiency"] = weak_efficiency(base["tokens_per_s_per_device"], row["tokens_per_s_per_device"])
            row["speedup"] = None
        else:
            row["speedup"] = base["step_time_mean_s"] / row["step_time_mean_s"]
            row["efficiency"] = strong_efficiency(
                base["step_time_mean_s"], base["devices"], row["step_time_mean_s"], row["devices"]
            )
    return rows
