"""gloo collectives on this machine: all-reduce, reduce-scatter (gloo's own, and optimus's all-to-all + sum,
`optimus.parallel.collectives.reduce_scatter_sum`) and all-gather, one process per rank, one thread each.

What the optimizer's sharding schemes cost on a CPU cluster depends on these: ZeRO reduce-scatters every
gradient and all-gathers every parameter. Times are medians over repetitions, rank 0's, in milliseconds.

    python benchmarks/collectives.py [--worlds 2 4] [--mib 4 16] [--reps 10] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optimus.parallel.collectives import reduce_scatter_sum

_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _time(fn, reps: int) -> float:
    fn()  # warm-up: buffers, connections
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _operations(src: torch.Tensor, block: torch.Tensor, full: torch.Tensor) -> dict:
    return {
        "all_reduce": lambda: dist.all_reduce(src),
        "reduce_scatter (gloo)": lambda: _reduce_scatter_tensor(block, src),
        "reduce_scatter_sum (all-to-all + sum)": lambda: reduce_scatter_sum(block, src, dist.group.WORLD),
        "all_gather": lambda: _all_gather_tensor(full, block),
    }


def _rank(rank: int, world: int, numels: list[int], reps: int, init_file: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = []
    for n in numels:
        src, block, full = torch.randn(n), torch.empty(n // world), torch.empty(n)  # [n], [n / world], [n]
        ops = _operations(src, block, full)
        rows.append({"world": world, "mib": n * 4 / 2**20, **{op: _time(fn, reps) for op, fn in ops.items()}})
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    numels = [m * 2**20 // 4 for m in args.mib]
    ctx, rows = mp.get_context("spawn"), []
    for world in args.worlds:
        results = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "init")
            procs = [
                ctx.Process(target=_rank, args=(r, world, numels, args.reps, init_file, results)) for r in range(world)
            ]
            for p in procs:
                p.start()
            rows += results.get(timeout=600)
            for p in procs:
                p.join()
    flags = subprocess.run(
        "grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u", shell=True, capture_output=True, text=True
    )
    header = f"machine: {os.cpu_count()} cores ({' '.join(flags.stdout.split())}), load {os.getloadavg()[0]:.2f}"
    ops = [k for k in rows[0] if k not in ("world", "mib")]
    lines = [header, "", "| ranks | fp32 MiB | " + " | ".join(ops) + " |", "|---" * (len(ops) + 2) + "|"]
    lines += [f"| {r['world']} | {r['mib']:.0f} | " + " | ".join(f"{r[op]:.1f}" for op in ops) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "collectives_cpu.md").write_text(f"Command: `python benchmarks/collectives.py`\n\n{text}")
    (args.out / "collectives_cpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
