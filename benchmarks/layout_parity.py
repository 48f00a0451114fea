"""Layout parity of whole training runs: every layout's loss and grad-norm trajectory against one process.

Runs `optimus train` (fp32, the default tiny model with 12 experts and top-3, clipping on)
for each layout and reports the largest relative difference of `loss` and `grad_norm`
over the steps from the single-process run with `optim.sharding=none`, plus the step-1
grad norm of every run against an fp64 norm of the single process's step-1 gradients.
Not a test (the suite checks the same at small sizes): it shows the parity at this size.

    python benchmarks/layout_parity.py [--steps 8] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from memory import ADAMW  # benchmarks/ is the script's directory, first on sys.path

COMMON = [
    *ADAMW, "model.moe.n_experts=12", "model.moe.top_k=3", "train.dtype=fp32", "kernels=torch", "train.seed=3",
    "train.seq_len=64", "train.global_batch=8", "logging.progress=false", "train.eval_interval=100000",
    "train.eval_sequences=4",
]  # fmt: skip
# name: (micro_batch, overrides). The load-balancing loss is a per-micro-batch quantity, so each
# layout is compared with the single process that accumulates over micro-batches of its size.
LAYOUTS = {
    "1 rank, standard": (8, ["optim.sharding=standard"]),
    "1 rank, ep_aware zero2": (8, ["optim.sharding=ep_aware", "optim.zero=2"]),
    "1 rank, ep_aware zero2, accum 4": (2, ["optim.sharding=ep_aware", "optim.zero=2"]),
    "4 ranks ep1, standard": (2, ["parallel.nproc=4", "optim.sharding=standard"]),
    "4 ranks ep2 alltoall, ep_aware zero2": (2, ["parallel.nproc=4", "parallel.ep=2", "optim.zero=2"]),
    "4 ranks ep2 allgather, standard, accum 2": (1, ["parallel.nproc=4", "parallel.ep=2",
                                                     "parallel.dispatcher=allgather", "optim.sharding=standard"]),
    "4 ranks ep4 allgather, standard": (2, ["parallel.nproc=4", "parallel.ep=4", "parallel.dispatcher=allgather",
                                            "optim.sharding=standard"]),
    "4 ranks ep4 alltoall, none": (2, ["parallel.nproc=4", "parallel.ep=4", "optim.sharding=none"]),
}  # fmt: skip


def run(overrides: list[str], run_dir: Path, steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "optimus", "train", *COMMON, f"train.steps={steps}", f"run.dir={run_dir}", *overrides]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]  # the steps


def fp64_step1_norm(work: Path, micro_batch: int) -> float:
    """The single process's step-1 gradients (before clipping), their norm summed in fp64."""
    from optimus.cli import load_config
    from optimus.train.step import micro_batch_loss
    from optimus.train.trainer import Trainer

    overrides = [*COMMON, "optim.sharding=none", f"train.micro_batch={micro_batch}", f"run.dir={work / 'fp64'}"]
    trainer = Trainer.from_config(load_config(overrides))
    try:
        for batch in trainer.loader.next_step():
            loss = micro_batch_loss(trainer.model, batch, trainer.cfg, trainer.platform)
            (loss / trainer.accum).backward()
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        return math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    finally:
        trainer.loader.close()


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def row(name: str, metrics: list[dict], ref: list[dict], fp64_norm: float) -> dict:
    return {
        "layout": name,
        "step1_grad_norm": metrics[0]["grad_norm"],
        "step1_vs_fp64": rel(metrics[0]["grad_norm"], fp64_norm),
        "max_loss_rel": max(rel(m["loss"], r["loss"]) for m, r in zip(metrics, ref)),
        "max_grad_norm_rel": max(rel(m["grad_norm"], r["grad_norm"]) for m, r in zip(metrics, ref)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    micro_batches = sorted({mb for mb, _ in LAYOUTS.values()})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fp64 = {mb: fp64_step1_norm(work, mb) for mb in micro_batches}
        refs = {mb: run(["optim.sharding=none", f"train.micro_batch={mb}"], work / f"ref{mb}", args.steps)
                for mb in micro_batches}  # fmt: skip
        results = {
            name: (mb, run([*extra, f"train.micro_batch={mb}"], work / str(i), args.steps))
            for i, (name, (mb, extra)) in enumerate(LAYOUTS.items())
        }
    rows = []
    for mb in micro_batches:
        rows.append(row(f"1 rank, none, micro_batch {mb} (reference)", refs[mb], refs[mb], fp64[mb]))
    for name, (mb, metrics) in results.items():
        rows.append(row(f"{name}, micro_batch {mb}", metrics, refs[mb], fp64[mb]))
    lines = [
        f"# Layout parity, fp32, {args.steps} steps (`python benchmarks/layout_parity.py`)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}; model: default tiny "
        "with 12 experts, top-3; each layout against the single process with the same micro-batch size "
        f"(step-1 fp64 norms: {', '.join(f'micro_batch {mb}: {n:.9f}' for mb, n in fp64.items())}).",
        "",
        "| layout | step-1 grad norm | vs fp64 | max loss diff | max grad-norm diff |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['step1_grad_norm']:.9f} | {r['step1_vs_fp64']:.1e} | {r['max_loss_rel']:.1e} "
            f"| {r['max_grad_norm_rel']:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "layout_parity_cpu.md").write_text(text)
    (args.out / "layout_parity_cpu.json").write_text(json.dumps({"fp64_step1_norm": fp64, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
