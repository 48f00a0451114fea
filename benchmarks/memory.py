"""Measured peak memory of CPU training runs, against what the model's size and `optimus plan` predict.

Two measurements, each through `optimus train` (one optimizer step, fp32, the tiny model), read
from run_info.json: the busiest rank's peak resident set (VmHWM) after the first step, and what
that rank held before the model was built (the interpreter, torch, the data).

- growth: the peak at `model.moe.n_experts` = --experts-from and = --experts-to on `--nproc`
  ranks with `parallel.ep` = `--nproc`. The growth should be the rank's own share of the new
  experts (fp32 parameter + gradient + two Adam moments = 16 bytes per element), not more:
  a rank that built the whole model, or held its parameters twice, grows by far more.
- plan: for a few layouts and activation-checkpointing modes, the peak net of the pre-model
  baseline against `optimus plan`'s total (state + activations of one micro-batch).

    python benchmarks/memory.py [--nproc 8] [--experts-from 8] [--experts-to 512] [--skip-growth] [--skip-plan]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from optimus.model import count_params_of_config
from optimus.recipes import load_config

MB, MIB = 1e6, 2**20
# The optimizer of the committed results of the benchmarks that use it (AdamW at the tiny model's tuned lr):
# measured before the default run moved to Muon, so that their recorded commands still reproduce them.
ADAMW = ["optim.update=adamw", "optim.lr=3e-3"]
SAMPLER = Path(__file__).resolve().parent / "heap_sampler"
STEP = [*ADAMW, "train.steps=1", "train.dtype=fp32", "logging.progress=false", "machine.peak_flops=1e12"]
LAYOUTS = {  # name: overrides
    "1 process": ["train.micro_batch=8"],
    "1 process, selective": ["train.micro_batch=8", "train.activation_checkpointing=selective"],
    "1 process, full": ["train.micro_batch=8", "train.activation_checkpointing=full"],
    "nproc=2 ep=2": ["parallel.nproc=2", "parallel.ep=2", "train.micro_batch=4"],
    "nproc=4 ep=2 ZeRO-2": ["parallel.nproc=4", "parallel.ep=2", "train.micro_batch=2", "optim.zero=2"],
    "nproc=4 ep=2 ZeRO-2, full": [
        "parallel.nproc=4", "parallel.ep=2", "train.micro_batch=2", "optim.zero=2",
        "train.activation_checkpointing=full",
    ],
}  # fmt: skip


def cpu_flags() -> str:
    """The AVX-512 extensions of this CPU (what decides which kernels torch runs)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "flags unknown"
    return " ".join(sorted(set(re.findall(r"\bavx512[a-z_0-9]*", text)))) or "no AVX-512"


def machine_meta(script: str) -> dict:
    """What a benchmark result records about its run: the time, the command, the machine, its CPU flags, the torch
    version and the load average at the start (a benchmark adds `load_end` when it finishes)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "torch": torch.__version__,
        "load_start": os.getloadavg()[0],
    }


def run(overrides: list[str], run_dir: Path) -> dict:
    """One `optimus train` run; the busiest rank's figures from run_info.json, and from the heap sampler
    (benchmarks/heap_sampler) the largest growth of the bytes in use over the ranks, with what the busiest
    rank had paged in of the libraries' code at its resident peak."""
    samples = run_dir / "heap_samples"
    samples.mkdir(parents=True)
    path = os.pathsep.join(filter(None, [str(SAMPLER), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OPTIMUS_HEAP_SAMPLES": str(samples), "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "optimus", "train", *STEP, *overrides, f"run.dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    info = json.loads((run_dir / "run_info.json").read_text())
    busiest = max(info["per_rank"], key=lambda r: r["peak_memory_bytes"])
    ranks = [json.loads(f.read_text()) for f in samples.glob("*.json")]
    in_use = max(r["at_peak_in_use"]["in_use"] - r["before"]["in_use"] for r in ranks)
    resident = max(ranks, key=lambda r: r["at_peak_rss"]["rss"])
    return {
        "peak_bytes": busiest["peak_memory_bytes"],
        "before_model_bytes": busiest["before_model_bytes"],
        "planned_bytes": info["planned_memory_bytes"],
        "peak_in_use_growth_bytes": in_use,
        "code_pages_growth_bytes": resident["at_peak_rss"]["file"] - resident["before"]["file"],
    }


def own_share_bytes(nproc: int, experts_from: int, experts_to: int) -> float:
    """16 bytes (fp32 parameter, gradient, two moments) per element of the new experts one rank holds."""
    per_expert = count_params_of_config(load_config([f"model.moe.n_experts={experts_to}"]).model).expert / experts_to
    return 16 * per_expert * (experts_to - experts_from) / nproc


def growth(nproc: int, experts_from: int, experts_to: int, tmp: Path) -> dict:
    layout = [f"parallel.nproc={nproc}", f"parallel.ep={nproc}", "train.micro_batch=1"]
    peaks = {e: run([*layout, f"model.moe.n_experts={e}"], tmp / f"experts{e}")["peak_bytes"] for e in
             (experts_from, experts_to)}  # fmt: skip
    grown, share = peaks[experts_to] - peaks[experts_from], own_share_bytes(nproc, experts_from, experts_to)
    return {
        "command": f"optimus train {' '.join(STEP + layout)} model.moe.n_experts=<E>",
        "peak_bytes": peaks,
        "growth_bytes": grown,
        "own_share_bytes": share,
        "ratio": grown / share,
    }


def plan_vs_measured(tmp: Path) -> dict:
    out = {}
    for name, overrides in LAYOUTS.items():
        r = run(overrides, tmp / name.replace(" ", "_").replace(",", "").replace("=", ""))
        net = r["peak_bytes"] - r["before_model_bytes"]
        out[name] = {
            **r, "overrides": overrides, "net_peak_bytes": net, "ratio": net / r["planned_bytes"],
            "in_use_ratio": r["peak_in_use_growth_bytes"] / r["planned_bytes"],
        }  # fmt: skip
    return out


def report(results: dict) -> str:
    lines = [f"machine: {results['machine']}", ""]
    g = results.get("growth")
    if g:
        lo, hi = sorted(g["peak_bytes"], key=int)
        lines += [
            f"growth: `{g['command']}`",
            f"peak {g['peak_bytes'][lo] / MB:.0f} MB at {lo} experts, {g['peak_bytes'][hi] / MB:.0f} MB at {hi}: "
            f"grew {g['growth_bytes'] / MB:.0f} MB; the rank's share of the new experts is "
            f"{g['own_share_bytes'] / MB:.0f} MB; ratio {g['ratio']:.3f}",
            "",
        ]
    if results.get("plan"):
        lines += [
            "| layout | peak (MiB) | before the model (MiB) | peak - before (MiB) | optimus plan (MiB) | ratio "
            "| heap in use, growth (MiB) | ratio | code pages paged in (MiB) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in results["plan"].items():
            lines.append(
                f"| {name} | {r['peak_bytes'] / MIB:.1f} | {r['before_model_bytes'] / MIB:.1f} | "
                f"{r['net_peak_bytes'] / MIB:.1f} | {r['planned_bytes'] / MIB:.1f} | {r['ratio']:.3f} | "
                f"{r['peak_in_use_growth_bytes'] / MIB:.1f} | {r['in_use_ratio']:.3f} | "
                f"{r['code_pages_growth_bytes'] / MIB:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--experts-from", type=int, default=8)
    parser.add_argument("--experts-to", type=int, default=512)
    parser.add_argument("--skip-growth", action="store_true")
    parser.add_argument("--skip-plan", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    load = os.getloadavg()
    path = args.out / "memory_cpu.json"
    results = json.loads(path.read_text()) if path.exists() else {}  # a skipped part keeps its last figures
    results["machine"] = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores ({cpu_flags()}), load {load[0]:.2f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_growth:
            results["growth"] = growth(args.nproc, args.experts_from, args.experts_to, Path(tmp))
        if not args.skip_plan:
            results["plan"] = plan_vs_measured(Path(tmp))
    text = report(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "memory_cpu.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
