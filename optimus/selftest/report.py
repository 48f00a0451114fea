"""What the selftest prints and writes: one table, selftest.json, machine.yaml.

machine.yaml is a machine recipe (`# @package machine`): the recipe's machine keys, with the numbers this node
measured in their place, each commented with where and when it was measured. `optimus selftest --out` and
`optimus plan --calibrate --out` write it through `machine_yaml`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics

from optimus.config import RANGED_PERF_KEYS, MachineConfig, MachinePerfConfig

CALIBRATED = "calibrated"  # machine.yaml's name where the recipe was `local`, which would measure on the spot
COLUMN = 34


# ---------------------------------------------------------------------------------------------
# The report, from every rank's results


def build_report(context: dict, ranks: list[dict]) -> dict:
    """selftest.json: `context` (device, versions, recipe) and every rank's results, with the medians over the
    ranks of each rate and every failure sentence."""
    kernels = None
    if ranks[0]["kernels"] is not None:
        kernels = {key: ranks[0]["kernels"][key] for key in ("setting", "backend", "dtype", "none")}
        kernels["results"] = [{"rank": r["rank"], **row} for r in ranks for row in r["kernels"]["results"]]
        kernels["skipped"] = [{"rank": r["rank"], **row} for r in ranks for row in r["kernels"]["skipped"]]
    report = {**context, "kernels": kernels, "rates": _rates(ranks), "collectives": ranks[0]["collectives"]}
    if "operators" in ranks[0]:
        report["operators"] = _operators(ranks)
    report["failures"] = failures(report)
    report["ok"] = not report["failures"]
    return report


def _rates(ranks: list[dict]) -> dict:
    """Each rate's median over the ranks (one device each), and each rank's."""
    per_rank = [{"rank": r["rank"], **r["rates"]} for r in ranks]
    gemm = per_rank[0]["gemm"]
    fractions = [r["gemm"]["fraction_of_peak"] for r in per_rank if r["gemm"]["fraction_of_peak"] is not None]
    return {
        "gemm_flops_per_s": statistics.median(r["gemm"]["flops_per_s"] for r in per_rank),
        "gemm_fraction_of_peak": statistics.median(fractions) if fractions else None,
        "gemm_shape": gemm["shape"],
        "gemm_dtype": gemm["dtype"],
        "peak_flops": gemm["peak_flops"],
        "peak_source": gemm["peak_source"],
        "bf16_peak": per_rank[0].get("bf16_peak"),  # a CPU's, where the GEMM ran in fp32
        "memory_bandwidth_bytes_per_s": statistics.median(r["memory_bandwidth"]["bytes_per_s"] for r in per_rank),
        "memory_bandwidth_how": per_rank[0]["memory_bandwidth"]["how"],
        "kernel_floor_s": statistics.median(r["kernel_floor"]["seconds"] for r in per_rank),
        "kernel_floor_how": per_rank[0]["kernel_floor"]["how"],
        "per_rank": per_rank,
    }


def _operators(ranks: list[dict]) -> dict[str, float]:
    """Each operator's median seconds over the ranks (one device each), of those every rank timed."""
    timed = [r["operators"] for r in ranks]
    return {sig: statistics.median(t[sig] for t in timed) for sig in timed[0] if all(sig in t for t in timed)}


def operators_json(report: dict) -> str:
    """operators.json (machine.perf.operator_times): the operators a calibration timed, and where, when, of what."""
    from optimus.perf.op_timing import operator_times_json

    d = report["device"]
    measured = {
        "device": f"{d['processes']} x {d['name']}",
        "host": report["host"],
        "date": report["date"],
        "torch": report["versions"]["torch"],
        "step": report["step"],
        "distinct": report["signatures"],
    }
    return operator_times_json(report.get("operators", {}), measured, MEASURED_SPREAD)


def failures(report: dict) -> list[str]:
    """One sentence per failure: each kernel, dtype and case that is off (on the first rank where it is),
    each collective that computed wrong values."""
    first: dict[tuple[str, str, str], str] = {}  # (kernel, dtype, case) -> the sentence of its first rank
    for row in (report["kernels"] or {}).get("results", []):
        if not row["ok"]:
            first.setdefault((row["kernel"], row["dtype"], row["case"]), row["failure"])
    sentences = list(first.values())
    for kind in (report["collectives"] or {}).get("kinds", []):
        sentences += kind["failures"]
    return sentences


def to_json(report: dict) -> str:
    return json.dumps(report, indent=2, allow_nan=False) + "\n"


# ---------------------------------------------------------------------------------------------
# The table


def _g(x: float | None, unit: str = "", digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}{unit}"


def _us(x: float) -> str:
    """Microseconds without an exponent: 3 significant digits below 1000, whole ones above."""
    return f"{x:.0f}" if x >= 1000 else f"{x:.3g}"


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"


def format_table(report: dict, title: str = "optimus selftest") -> str:
    d = report["device"]
    lines = [
        f"{title} on {d['name']} ({d['type']}, {d['processes']} process{'es' if d['processes'] > 1 else ''})"
        f", torch {report['versions']['torch']}, triton {report['versions']['triton'] or '-'}; "
        f"recipe model={report['recipe']['model']} machine={report['recipe']['machine']}, "
        f"compute dtype {report['recipe']['compute_dtype']}",
    ]
    if report["kernels"] is not None:
        lines += ["", *_kernel_lines(report["kernels"], d["processes"])]
    lines += ["", *_rate_lines(report["rates"], d["processes"])]
    lines += ["", *_collective_lines(report["collectives"])]
    if "operators" in report:
        lines += ["", _operators_line(report)]
    n = len(report["failures"])
    lines += ["", f"{title}: passed" if not n else f"{title}: FAILED, {n} failure{'s' if n > 1 else ''} (on stderr)"]
    return "\n".join(lines)


def _kernel_lines(kernels: dict, processes: int) -> list[str]:
    if kernels["none"]:
        return [f"kernels: {kernels['none']}"]
    auto = " (kernels=auto)" if kernels["setting"] == "auto" else ""
    head = f"kernels: {kernels['backend']} backend{auto} in {kernels['dtype']} against the fp32 reference"
    head += f" on each of {processes} devices" if processes > 1 else ""
    lines = [head + " (tolerances: optimus/kernels/check.py)"]
    lines.append(f"  {'kernel':<{COLUMN - 2}}{'passed':>8}{'worst error':>14}{'tolerance':>12}  worst at")
    by_kernel: dict[str, list[dict]] = {}
    for row in kernels["results"]:
        by_kernel.setdefault(row["kernel"], []).append(row)
    for name, rows in by_kernel.items():
        worst = max(rows, key=lambda row: math.inf if row["error"] is None else row["error"])
        passed = sum(row["ok"] for row in rows)
        error = "NaN/Inf" if worst["error"] is None else f"{worst['error']:.2e}"
        where = worst["case"] + (f" (rank {worst['rank']})" if processes > 1 else "")
        mark = "" if passed == len(rows) else "  FAILED"
        lines.append(
            f"  {name:<{COLUMN - 2}}{f'{passed}/{len(rows)}':>8}{error:>14}{worst['tolerance']:>12.1e}  {where}{mark}"
        )
    for skip in kernels["skipped"]:
        budget = skip["budget_bytes"]
        budget = "" if budget is None else f"; a quarter of the free memory is {_gib(budget)}"
        why = "ran out of memory: " if skip.get("ran_out_of_memory") else ""
        lines.append(f"  skipped {skip['case']} ({why}needs about {_gib(skip['bytes'])}{budget})")
    return lines


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _flops(x: float) -> str:
    return f"{x / 1e12:.4g} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.4g} GFLOP/s"


def _rate_lines(rates: dict, processes: int) -> list[str]:
    over = f" (median over {processes} devices)" if processes > 1 else ""
    m, k, n = rates["gemm_shape"]
    peak = rates["peak_flops"]
    of_peak = (
        f"{rates['gemm_fraction_of_peak']:.2f} of the peak {_flops(peak)} ({rates['peak_source']})"
        if peak
        else "peak unknown (set machine.peak_flops)"
    )
    rows = [
        (f"GEMM {rates['gemm_dtype']} [{m}, {k}] x [{k}, {n}]", _flops(rates["gemm_flops_per_s"]), of_peak),
        ("memory bandwidth", f"{rates['memory_bandwidth_bytes_per_s'] / 1e9:.4g} GB/s", rates["memory_bandwidth_how"]),
        ("kernel floor", f"{rates['kernel_floor_s'] * 1e6:.3g} us", rates["kernel_floor_how"]),
    ]
    width = max(COLUMN - 2, *(len(label) for label, _, _ in rows))
    return [f"rates the performance model assumes{over}"] + [
        f"  {label:<{width}}{value:>16}  {note}" for label, value, note in rows
    ]


def _operators_line(report: dict) -> str:
    timed, distinct = report["operators"], report["signatures"]
    total = sum(timed.values())
    return (
        f"operators: {len(timed)} of the {distinct} distinct operators of the step of {report['step']} timed "
        f"(one call of each: {_us(total * 1e6)} us in all); the rest replay only with the step's own data: roofline"
    )


def _collective_lines(collectives: dict) -> list[str]:
    if "none" in collectives:
        return [f"collectives: {collectives['none']}"]
    sizes = collectives["sizes_bytes"]
    lines = [
        f"collectives: {collectives['backend']}, {collectives['group']} group of {collectives['processes']} "
        f"processes, {collectives['dtype']}; bus bandwidth in GB/s by size, latency of the smallest",
        f"  {'collective':<{COLUMN - 2}}{'values':>8}" + "".join(f"{_size(s):>10}" for s in sizes) + f"{'latency':>12}",
    ]
    for kind in collectives["kinds"]:
        rates = (
            "".join(f"{_g(bw):>10}" for bw in kind["bus_gbs"]) if kind["ok"] else "".join(f"{'-':>10}" for _ in sizes)
        )
        latency = f"{_us(kind['latency_us'])} us" if kind["ok"] else "-"
        lines.append(f"  {kind['name']:<{COLUMN - 2}}{'exact' if kind['ok'] else 'WRONG':>8}{rates}{latency:>12}")
    link = collectives["node_link"]
    if link:
        lines.append(
            f"  node link (the all_reduce as optimus.perf.costs prices it): {link['gbs']:.4g} GB/s, "
            f"{_us(link['latency_us'])} us latency"
        )
    return lines


# ---------------------------------------------------------------------------------------------
# machine.yaml


# Where a measured range stops short of what the machine's checks refuse (optimus.config_checks): efficiencies at
# 1, a rank's variability, a fraction of a step below 1, by a margin (a fit at or above it is not written).
RANGE_CAPS = {"rank_variability": 0.99}


def measured_machine_values(report: dict) -> dict[str, tuple[object, str, bool]]:
    """{dotted key: (value, how it was found, measured)} of the machine keys the selftest measured, or found
    (the ranks per node, the peak and the device's memory: what a recipe may leave to be looked up)."""
    rates, device = report["rates"], report["device"]
    m, k, n = rates["gemm_shape"]
    values: dict[str, tuple[object, str, bool]] = {}
    fraction, peak = rates["gemm_fraction_of_peak"], rates["peak_flops"]
    if fraction is not None:
        above = " (capped at 1: the peak is a probe that the product beat)" if fraction > 1 else ""
        values["perf.gemm_efficiency"] = (
            min(fraction, 1.0),
            f"{_flops(rates['gemm_flops_per_s'])} {rates['gemm_dtype']} at [{m}, {k}] x [{k}, {n}] over the peak "
            f"{_flops(peak)} ({rates['peak_source']}){above}",
            True,
        )
    bandwidth = rates["memory_bandwidth_bytes_per_s"] / 1e9
    values["perf.memory_bandwidth_gbs"] = (bandwidth, rates["memory_bandwidth_how"], True)
    values["perf.kernel_floor_us"] = (rates["kernel_floor_s"] * 1e6, rates["kernel_floor_how"], True)
    values |= _collective_values(report["collectives"])
    if "operators" in report:
        how = f"{len(report['operators'])} of the {report['signatures']} distinct operators of the step of "
        how += f"{report['step']}, timed by every process (optimus.perf.op_timing)"
        values["perf.operator_times"] = ("operators.json", how, True)
    values["ranks_per_node"] = (device["processes"], "the processes measured, one per device", False)
    # The peak of the GEMM's dtype, where the model reads it: bf16's, or a CPU's probed fp32 peak (an
    # accelerator's fp32 peak is derived from the bf16 one, optimus.selftest.rates.peak_flops).
    if peak and rates["gemm_dtype"] == "bf16":
        values["peak_flops"] = (peak, f"the bf16 peak ({rates['peak_source']})", False)
    elif peak and device["type"] == "cpu":
        values["perf.peak_flops_fp32"] = (peak, f"the fp32 peak ({rates['peak_source']})", False)
        if rates.get("bf16_peak"):
            bf16 = rates["bf16_peak"]
            values["peak_flops"] = (bf16["flops_per_s"], f"the bf16 peak ({bf16['source']})", False)
    if device.get("memory_bytes"):
        values["memory_gb"] = (device["memory_bytes"] / 2**30, "the device's memory in GiB", False)
    return values


def _collective_values(c: dict) -> dict[str, tuple[object, str, bool]]:
    """The machine keys that the selftest's collectives measured: the link inside the node, the ranks' sync cost
    and variability."""
    values: dict[str, tuple[object, str, bool]] = {}
    link = c.get("node_link")
    if link:
        how = f"all_reduce over {c['processes']} processes on {c['backend']}, fitted as optimus.perf.costs prices it"
        values["perf.node_gbs"] = (link["gbs"], how, True)
        values["perf.node_latency_us"] = (link["latency_us"], how, True)
    sync = c.get("sync")
    if sync:
        how = f"{c['processes']} {c['backend']} processes computing and meeting, fitted as optimus.perf.rank_sync"
        if sync["sync_cost_s"] > 0:  # a fit of 0 (no cost seen) stays null: none
            values["perf.sync_cost_us"] = (sync["sync_cost_s"] * 1e6, how, True)
        # A fit of nearly a whole step or more (ranks that share busy cores) is no fraction of a step the model
        # takes, and no range below its cap would hold it.
        if 0 < sync["rank_variability"] < RANGE_CAPS["rank_variability"]:
            values["perf.rank_variability"] = (sync["rank_variability"], how, True)
    return values


FOUND = ("ranks_per_node", "peak_flops", "memory_gb", "perf.peak_flops_fp32")  # filled in only where unset


def machine_yaml(machine: MachineConfig, report: dict, command: str) -> str:
    """The machine recipe of `machine` with this node's measurements in place, as `command` found them.
    Measured performance numbers replace the recipe's; the ranks per node, the peaks and the memory fill in only
    what the recipe leaves null, so that a cluster recipe's sourced figures stay."""
    recipe = {f.name: getattr(machine, f.name) for f in dataclasses.fields(MachineConfig) if f.name != "perf"}
    recipe |= {f"perf.{f.name}": getattr(machine.perf, f.name) for f in dataclasses.fields(MachinePerfConfig)}
    values = {k: v for k, v in measured_machine_values(report).items() if k not in FOUND or recipe[k] is None}
    recipe["name"] = CALIBRATED if machine.name == "local" else machine.name
    d = report["device"]
    where = f"{command} on {d['name']}, {report['date']}"
    lines = [
        "# @package machine",
        f"# machine={machine.name} as measured by `{command}` on {d['processes']} x {d['name']} ({d['type']}) of "
        f"{report['host']}, {report['date']}.",
        "# Numbers commented `measured` are this node's, `found` were looked up here; the rest are the recipe's.",
        "# To use it: machine.calibration=DIR/machine.yaml (DIR: this file's directory) on any optimus command",
        '# that reads the machine (docs/ARCHITECTURE.md, "The selftest").',
    ]
    ranges = recipe.pop("perf.ranges")
    for key, value in recipe.items():
        if key.startswith("perf.") and lines[-1] != "perf:" and not lines[-1].startswith("  "):
            lines.append("perf:")
        lines.append(_entry(key, value, values.get(key), where))
    return "\n".join(lines + _range_lines(ranges, values, where)) + "\n"


MEASURED_SPREAD = 0.1  # the range of a number measured here: +-10% (ASSUMED: runs and nodes differ)


def _range_lines(ranges: dict, values: dict, where: str) -> list[str]:
    """machine.perf.ranges: a measured number's narrow one around it (MEASURED_SPREAD), the recipe's elsewhere."""
    lines = []
    for key in RANGED_PERF_KEYS:
        found = values.get(f"perf.{key}")
        if found is not None and found[2]:
            cap = RANGE_CAPS.get(key, 1.0 if key.endswith("efficiency") else float("inf"))
            low, high = found[0] * (1 - MEASURED_SPREAD), min(found[0] * (1 + MEASURED_SPREAD), cap)
            lines.append(f"    {key}: [{low:.4g}, {high:.4g}]  # measured by {where}, +-{MEASURED_SPREAD:.0%}")
        elif key in ranges:
            lines.append(f"    {key}: [{ranges[key][0]!r}, {ranges[key][1]!r}]  # the recipe's")
    return ["  ranges:", *lines] if lines else []


def _entry(key: str, value: object, found: tuple[object, str, bool] | None, where: str) -> str:
    indent, name = ("  ", key.removeprefix("perf.")) if key.startswith("perf.") else ("", key)
    if found is None:
        return f"{indent}{name}: {_yaml_scalar(value)}"
    number, how, measured = found
    verb = "measured" if measured else "found"
    return f"{indent}{name}: {_yaml_scalar(number, rounded=True)}  # {verb} by {where}: {how}"


def _yaml_scalar(value: object, rounded: bool = False) -> str:
    """A scalar as the recipes write it (and OmegaConf reads it back); `rounded` floats to four digits."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}" if rounded else repr(value)
    if isinstance(value, int):
        return str(value)
    text = str(value)
    plain = re.fullmatch(r"[A-Za-z][\w.-]*", text) and text not in ("null", "true", "false")
    return text if plain else json.dumps(text)
