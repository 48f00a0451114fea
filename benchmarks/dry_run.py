"""Dry runs of every experiment recipe at its published size: `optimus plan --dry-run` per recipe.

For each layout below it runs the CLI (one process per layout, one at a time) on the busiest rank, keeps
its rank<R>.json, and writes a table: world, rank, measured peak by category beside the planned bytes,
collectives per step and bytes by kind, host syncs per step, the dry run's wall time and the process's
peak resident memory. The CPU's flags are recorded with the results (the times depend on the machine).

    python benchmarks/dry_run.py [--only NAME ...] [--device cpu|cuda|rocm|xpu] [--name STEM] [--out benchmarks/results]

Each layout is traced on its recipe's device path (Aurora: xpu, Frontier: rocm) unless --device names one;
the results go to STEM.json and STEM.md (default dry_run_device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memory import cpu_flags  # benchmarks/ is the script's directory, first on sys.path

from optimus.dry_run import group_check_ranks

# (name, recipe overrides, nodes)
LAYOUTS = [
    ("aurora-mula-7b-a1b", ["experiment=aurora-mula-7b-a1b"], 256),
    ("aurora-mula-20b-a2b", ["experiment=aurora-mula-20b-a2b"], 256),
    ("aurora-mula-100b-a7b", ["experiment=aurora-mula-100b-a7b"], 256),
    ("aurora-mula-220b-a10b", ["experiment=aurora-mula-220b-a10b"], 256),
    # The seed paper's scaling point, weak-scaled: 4x the nodes, 4x the global batch (as many micro-batches per rank).
    ("aurora-mula-220b-a10b @1024", ["experiment=aurora-mula-220b-a10b", "train.global_batch=12288"], 1024),
    ("frontier-22b", ["experiment=frontier-22b"], 128),
    ("frontier-175b", ["experiment=frontier-175b"], 128),
    ("frontier-1t", ["experiment=frontier-1t"], 384),
    ("frontier-mula-20b-a2b", ["experiment=frontier-mula-20b-a2b"], 384),
    ("frontier-mula-100b-a7b", ["experiment=frontier-mula-100b-a7b"], 384),
    ("frontier-mula-220b-a10b", ["experiment=frontier-mula-220b-a10b"], 384),
    ("aurora-deepseek-v3-1t", ["experiment=aurora-deepseek-v3-1t"], 192),  # the stretch: ~1.1T, 58B active
    # Frontier's MoE layout on as many NVIDIA nodes (8 GPUs of 80 GB each): the cuda path, H100's peak
    (
        "nvidia-mula-220b-a10b",
        ["experiment=frontier-mula-220b-a10b", "machine=nvidia", "machine.peak_flops=989e12"],
        384,
    ),  # fmt: skip
]
MIB, GIB = 2**20, 2**30


def run_layout(overrides: list[str], nodes: int, out: Path, device: str | None = None) -> dict:
    """One dry run through the CLI; its rank file, wall time and the child's peak resident set."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "optimus", "plan", "--dry-run", "--nodes", str(nodes), "--out", str(out)]
    command += ["--device", device] if device else []
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen([*command, *overrides], stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage: its peak resident set
        child.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    seconds = time.perf_counter() - started
    if child.returncode != 0:
        return {"error": output.strip().splitlines()[-1], "seconds": seconds}
    rank_file = next(out.glob("rank*.json"))
    result = json.loads(rank_file.read_text())
    result["collectives_by_kind"] = by_kind(result.pop("collectives"))
    result["wall_seconds"] = seconds
    result["max_rss_bytes"] = usage.ru_maxrss * 1024  # KiB on Linux
    return result


def by_kind(calls: list[dict]) -> dict:
    kinds: dict[str, dict] = {}
    for call in calls:
        kind = kinds.setdefault(call["op"], {"calls": 0, "bytes": 0})
        kind["calls"] += 1
        kind["bytes"] += call["bytes"]
    return kinds


def table(results: dict) -> str:
    lines = [
        "| layout | path (kernels) | world | rank | peak GiB measured | planned GiB | measured/planned "
        "| at the peak (GiB) "
        "| collectives: calls (GiB) by kind | host syncs | dry run s | RSS GiB | --check-groups: ranks, hours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | | | | failed: {r['error']} | | | | | | {r['seconds']:.0f} | |")
            continue
        mem = r["memory"]
        cats = ", ".join(f"{k} {v / GIB:.2f}" for k, v in mem["by_category"].items() if v >= GIB / 100)
        kinds = ", ".join(
            f"{op} {k['calls']} ({k['bytes'] / GIB:.2f})" for op, k in sorted(r["collectives_by_kind"].items())
        )
        syncs = sum(s["count"] for s in r["host_syncs"])
        lay = r["layout"]
        check = len(group_check_ranks(r["world"], lay["pp"], lay["tp"], lay["ep"]))
        lines.append(
            f"| {name} | {r.get('device', 'cpu')} ({r.get('kernels', 'torch')}) | {r['world']} | {r['rank']} "
            f"| {mem['peak_bytes'] / GIB:.2f} | {mem['planned_bytes'] / GIB:.2f} "
            f"| {mem['peak_bytes'] / mem['planned_bytes']:.3f} | {cats} | {kinds} | {syncs} "
            f"| {r['wall_seconds']:.0f} | {r['max_rss_bytes'] / GIB:.2f} "
            f"| {check}, {check * r['wall_seconds'] / 3600:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="names of LAYOUTS to run (default: all)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", help="the device path to trace (default: each recipe's machine.device)")
    parser.add_argument("--name", default="dry_run_device", help="the results' file stem")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides, nodes in LAYOUTS:
            if args.only and name not in args.only:
                continue
            out_dir = Path(tmp) / name.replace(" ", "_").replace("@", "n")
            results[name] = run_layout(overrides, nodes, out_dir, args.device)
            print(table({name: results[name]}).splitlines()[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {"cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "torch": torch_version()}
    (out / f"{args.name}.json").write_text(json.dumps({"machine": machine, "results": results}, indent=1) + "\n")
    (out / f"{args.name}.md").write_text(report(results, machine, args.device))
    print(table(results))


def torch_version() -> str:
    import torch

    return torch.__version__


def report(results: dict, machine: dict, device: str | None) -> str:
    lines = [
        "# Dry runs of the experiment recipes at their published size",
        "",
        "`python benchmarks/dry_run.py` runs, for each layout, `optimus plan --dry-run --nodes N "
        f"experiment=NAME --out DIR{' --device ' + device if device else ''}` (the busiest rank, "
        f"{'on its recipe' + chr(39) + 's device path' if not device else 'on the ' + device + ' path'}, uniform "
        "routing) and tabulates its "
        f"rank<R>.json. Machine: {machine['cpus']} CPUs ({machine['cpu_flags']}), torch {machine['torch']}; "
        "the times are wall seconds of the whole command (start-up included) on a machine shared with other "
        "work, the resident set is the process's peak. The last column is how many ranks `--check-groups` runs "
        "for the layout (optimus.dry_run.group_check_ranks) and the hours that takes one after another at this "
        "rank's time.",
        "",
        table(results),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
