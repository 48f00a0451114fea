"""bf16 against fp32 on the default model: held-out loss after N steps, bytes per parameter, tokens/s.

Runs `optimus train` twice with the same seed and data, `train.dtype=fp32` and
`train.dtype=bf16` (bf16 parameters and activations, fp32 master weights, moments
and gradients), and reports the final `val_loss` of each, their relative
difference, and what run_info.json says each rank holds per parameter.

    python benchmarks/precision.py [--steps 100] [--seeds 0 1 2] [--out benchmarks/results]

With several seeds it also reports each seed's difference and the difference of the means: the
default model's router collapses onto a few experts in its first steps, which makes two runs that
differ in rounding alone land a few percent apart at 100 steps, in either direction.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from memory import ADAMW  # benchmarks/ is the script's directory, first on sys.path

from optimus.kernels.dtypes import cpu_has_fast_bf16


def run(dtype: str, steps: int, seed: int, run_dir: Path) -> dict:
    overrides = [
        *ADAMW, f"train.dtype={dtype}", f"train.steps={steps}", f"train.seed={seed}", f"train.eval_interval={steps}",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "optimus", "train", *overrides, "logging.progress=false", f"run.dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, env=os.environ)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]  # 0: start
    info = json.loads((run_dir / "run_info.json").read_text())
    rank0, total = info["per_rank"][0], info["params"]["total"]
    return {
        "val_loss": records[-1]["val_loss"],
        "median_tokens_per_s": sorted(r["tokens_per_s"] for r in records)[len(records) // 2],
        "bytes_per_param": {k: rank0[k] / total for k in ("param_bytes", "grad_bytes", "master_bytes",
                                                           "optim_state_bytes")},
    }  # fmt: skip


def seed_table(by_seed: dict) -> list[str]:
    """One row per seed, then the means: a systematic bf16 gap shows in the means, rounding chaos does not."""
    lines = ["", "| seed | fp32 val_loss | bf16 val_loss | bf16 vs fp32 |", "|---:|---:|---:|---:|"]
    for seed, r in by_seed.items():
        fp32, bf16 = r["fp32"]["val_loss"], r["bf16"]["val_loss"]
        lines.append(f"| {seed} | {fp32:.4f} | {bf16:.4f} | {(bf16 - fp32) / fp32:+.2%} |")
    mean = {d: sum(r[d]["val_loss"] for r in by_seed.values()) / len(by_seed) for d in ("fp32", "bf16")}
    gap = (mean["bf16"] - mean["fp32"]) / mean["fp32"]
    lines.append(f"| mean | {mean['fp32']:.4f} | {mean['bf16']:.4f} | {gap:+.2%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        by_seed = {
            seed: {dtype: run(dtype, args.steps, seed, Path(tmp) / f"{dtype}-{seed}") for dtype in ("fp32", "bf16")}
            for seed in args.seeds
        }
    results = by_seed[args.seeds[0]]
    diff = (results["bf16"]["val_loss"] - results["fp32"]["val_loss"]) / results["fp32"]["val_loss"]
    lines = [
        f"# bf16 vs fp32, default model, {args.steps} steps (`python benchmarks/precision.py --steps {args.steps}`)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, bf16 units: "
        f"{cpu_has_fast_bf16()}, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        "| dtype | val_loss | tokens/s | param B/param | grad B/param | master B/param | moments B/param |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, r in results.items():
        b = r["bytes_per_param"]
        lines.append(
            f"| {dtype} | {r['val_loss']:.4f} | {r['median_tokens_per_s']:,.0f} | {b['param_bytes']:.2f} | "
            f"{b['grad_bytes']:.2f} | {b['master_bytes']:.2f} | {b['optim_state_bytes']:.2f} |"
        )
    lines += ["", f"bf16 val_loss relative to fp32 (seed {args.seeds[0]}): {diff:+.2%}"]
    if len(args.seeds) > 1:
        lines += seed_table(by_seed)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "precision_cpu.md").write_text(text)
    (args.out / "precision_cpu.json").write_text(json.dumps({"steps": args.steps, "by_seed": by_seed}, indent=2))


if __name__ == "__main__":
    main()
