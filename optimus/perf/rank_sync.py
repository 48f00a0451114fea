"""What a collective costs ranks that arrive from computing, on a machine whose ranks share its cores (a CPU).

A rank that reaches a collective before its peers blocks, and gloo's waiting thread sleeps; the last peer's
arrival wakes it, and with every core computing that wake-up is not free. Two numbers describe it:

- `sync_cost`: seconds every collective costs beyond its transfer (the wake-up), the same for short and
  long stretches of work between collectives;
- `rank_variability`: how much a rank's stretch of work varies (a coefficient of variation), which makes
  the ranks arrive apart in proportion to the stretch: a collective after a stretch s waits
  s x cv x E[max of n standard normals] for the slowest (optimus.perf.stragglers prices the step's sum).

`machine=local` measures them (optimus.perf.machine.measure_sync): every rank computes the same stretch of
matrix products and meets the others at a barrier, many times, for a short and a long stretch; the time per
meeting beyond the stretch, less a barrier's own time when the ranks arrive together, is fitted as
sync_cost + s x cv x E[max of n]. A GPU's ranks wait on their device streams, not on the host's cores: the
cluster machines leave sync_cost at 0.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from optimus.perf.stragglers import expected_max_of_normals

STRETCHES_S = (0.005, 0.03)  # the short and the long stretch of work between two meetings
MEETINGS = 100


def fit_sync(stretches: list[tuple[float, float]], aligned_barrier: float, ranks: int) -> tuple[float, float]:
    """(sync_cost, rank_variability) from two (stretch s, seconds per meeting beyond s) measurements: the line
    through them is aligned_barrier + sync_cost + s x cv x E[max of `ranks` normals]; neither is below 0."""
    (s1, p1), (s2, p2) = stretches
    slope = max((p2 - p1) / (s2 - s1), 0.0)
    cv = slope / expected_max_of_normals(ranks)
    return max(p1 - aligned_barrier - slope * s1, 0.0), cv


def _stretch_of(a: torch.Tensor, products: int) -> float:
    start = time.perf_counter()
    for _ in range(products):
        a @ a
    return time.perf_counter() - start


def sync_rank(rank: int, world: int, init_file: str, results) -> None:
    """One of `world` gloo ranks of measure_sync: rank 0 puts ([(stretch, seconds per meeting beyond it)],
    a barrier's time when the ranks arrive together)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    measured, aligned = meetings()
    if rank == 0:
        results.put((measured, aligned))
    dist.destroy_process_group()


def meetings() -> tuple[list[tuple[float, float]], float]:
    """Every rank of the default process group computes the same stretches of matrix products and meets the others
    at a barrier after each: ([(stretch, seconds per meeting beyond it)] for the short and the long stretch, a
    barrier's time when the ranks arrive together), this rank's (fit_sync reads them)."""
    a = torch.randn(256, 256)
    per_product = _stretch_of(a, 50) / 50
    dist.barrier()
    aligned = []
    for _ in range(MEETINGS):
        dist.barrier()  # arrive together, then time the next one
        start = time.perf_counter()
        dist.barrier()
        aligned.append(time.perf_counter() - start)
    measured = []
    for stretch in STRETCHES_S:
        products = torch.tensor([max(1, round(stretch / per_product))])
        dist.all_reduce(products, op=dist.ReduceOp.MIN)  # the same work on every rank
        dist.barrier()
        start, work = time.perf_counter(), 0.0
        for _ in range(MEETINGS):
            work += _stretch_of(a, int(products))
            dist.barrier()
        measured.append((work / MEETINGS, (time.perf_counter() - start - work) / MEETINGS))
    return measured, statistics.median(aligned)
