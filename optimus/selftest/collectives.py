"""Each collective kind of the start-up check on the world group of this node: checked for exact values, then
timed at a few sizes.

The checks are optimus.parallel.collective_check's own (each input element has one contributing rank, so every
sum is exact), in the compute dtype and fp32, and the ranks agree on the result (one all-reduce, MAX) before any
kind is timed. A kind that computed wrong values anywhere is not timed. Times are each rank's median over
repeated runs, each after a barrier, and the slowest rank's median is the collective's (every rank waits for it).

Bus bandwidth is nccl-tests' convention, what one rank's link carries: an all-reduce of S bytes moves
2 (n - 1) / n S per rank, an all-gather (S the gathered output), a reduce-scatter (S its input) and an
all-to-all (S sent) (n - 1) / n S, a send to the next rank S. The node's link for the performance model
(machine.perf.node_gbs, node_latency_us) is fitted to the all-reduce at the smallest and the largest size as
optimus.perf.costs prices an all-reduce inside a node (a ring: 2 (n - 1) / n of the buffer at the link's
bandwidth, 2 (n - 1) latencies, optimus.perf.collectives), as optimus.perf.machine.measure_gloo fits gloo's
for machine=local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optimus.config import TORCH_DTYPES
from optimus.parallel import collective_check as cc
from optimus.parallel.collectives import _all_gather_tensor, reduce_scatter_sum
from optimus.perf.collectives import ring_steps
from optimus.perf.rank_sync import fit_sync, meetings
from optimus.selftest.rates import median_seconds

KIB, MIB = 2**10, 2**20
GPU_SIZES = (8 * KIB, MIB, 16 * MIB, 64 * MIB)
CPU_SIZES = (8 * KIB, 256 * KIB, MIB)  # gloo: a few milliseconds each
GPU_REPS, CPU_REPS = 20, 7
GROUP = "WORLD"  # the group every kind runs on: this node's processes


@dataclass(frozen=True)
class Kind:
    name: str
    check: Callable  # (group, dtype, device) -> values correct (collective_check's)
    alternative: str  # what to set instead when it computes wrongly
    timed: Callable  # (group, n_bytes, dtype, device) -> a function issuing the collective once
    bus_factor: Callable[[int], float]  # bytes one rank's link carries per byte of the size, for n ranks


def _elements(n_bytes: int, dtype: torch.dtype, multiple: int) -> int:
    """Elements of `dtype` in `n_bytes`, rounded down to a multiple of `multiple` (at least one multiple)."""
    return max(n_bytes // dtype.itemsize // multiple, 1) * multiple


def _all_reduce(group, n_bytes, dtype, device):
    x = torch.ones(_elements(n_bytes, dtype, 1), dtype=dtype, device=device)
    return lambda: dist.all_reduce(x, group=group)


def _all_to_all(group, n_bytes, dtype, device):
    n = dist.get_world_size(group)
    send = torch.ones(_elements(n_bytes, dtype, n), dtype=dtype, device=device)
    received = torch.empty_like(send)
    return lambda: dist.all_to_all_single(received, send, group=group)


def _all_gather(group, n_bytes, dtype, device):
    n = dist.get_world_size(group)
    out = torch.empty(_elements(n_bytes, dtype, n), dtype=dtype, device=device)
    mine = torch.ones(out.numel() // n, dtype=dtype, device=device)
    return lambda: _all_gather_tensor(out, mine, group=group)


def _reduce_scatter(group, n_bytes, dtype, device):
    n = dist.get_world_size(group)
    src = torch.ones(_elements(n_bytes, dtype, n), dtype=dtype, device=device)
    out = torch.empty(src.numel() // n, dtype=dtype, device=device)
    return lambda: reduce_scatter_sum(out, src, group)


def _send_recv(group, n_bytes, dtype, device):
    """Every rank sends to the next and receives from the previous at once (the pipeline's pattern)."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    send = torch.ones(_elements(n_bytes, dtype, 1), dtype=dtype, device=device)
    received = torch.empty_like(send)

    def exchange():
        ops = [
            dist.P2POp(dist.isend, send, dist.get_global_rank(group, (me + 1) % n), group),
            dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (me - 1) % n), group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return exchange


KINDS = (
    Kind("all_reduce", cc._check_all_reduce, cc._NO_FIX, _all_reduce, lambda n: 2 * (n - 1) / n),
    Kind("all_to_all with uneven splits", cc._check_all_to_all, cc._USE_ALLGATHER, _all_to_all, lambda n: (n - 1) / n),
    Kind("all_gather", cc._check_all_gather, cc._NO_FIX, _all_gather, lambda n: (n - 1) / n),
    Kind("reduce_scatter", cc._check_reduce_scatter, cc._NO_FIX, _reduce_scatter, lambda n: (n - 1) / n),
    Kind("send/recv", cc._check_neighbours, cc._NO_FIX, _send_recv, lambda n: 1.0),
)


def _wrong_values(kind: Kind, dtype: torch.dtype, device: torch.device) -> bool:
    try:
        return not kind.check(dist.group.WORLD, dtype, device)
    except Exception:  # a backend that refuses the collective (a dtype it lacks) computes nothing right either
        return True


def failure(kind: str, dtype: str, backend: str, alternative: str) -> str:
    """The sentence of a collective that computed wrong values, as the start-up check words it."""
    return (
        f"{kind} in {dtype} over the {GROUP} group returned wrong values on the {backend} backend; use {alternative}."
    )


def run_collectives(device: torch.device, compute_dtype: torch.dtype) -> dict:
    """Every kind checked in each dtype (the ranks agree), then the correct ones timed at the sizes for this
    device; the same record on every rank."""
    n = dist.get_world_size()
    backend = dist.get_backend()
    dtypes = list(dict.fromkeys([compute_dtype, torch.float32]))
    pairs = [(kind, dtype) for kind in KINDS for dtype in dtypes]
    wrong_P = torch.tensor([float(_wrong_values(kind, d, device)) for kind, d in pairs], device=device)
    dist.all_reduce(wrong_P, op=dist.ReduceOp.MAX)
    wrong = {pair for pair, flag in zip(pairs, wrong_P.tolist()) if flag}
    sizes = CPU_SIZES if device.type == "cpu" else GPU_SIZES
    reps = CPU_REPS if device.type == "cpu" else GPU_REPS
    kinds = []
    for kind in KINDS:
        failures = [
            failure(kind.name, str(d).removeprefix("torch."), backend, kind.alternative)
            for d in dtypes
            if (kind, d) in wrong
        ]
        seconds = [] if failures else _timed(kind, sizes, compute_dtype, device, reps)
        kinds.append({
            "name": kind.name,
            "ok": not failures,
            "failures": failures,
            "seconds": seconds,
            "bus_gbs": [kind.bus_factor(n) * size / t / 1e9 for size, t in zip(sizes, seconds)],
            "latency_us": seconds[0] * 1e6 if seconds else None,
        })  # fmt: skip
    all_reduce = kinds[0]["seconds"]
    return {
        "sync": measured_sync(n) if device.type == "cpu" and n > 1 else None,
        "backend": backend,
        "group": GROUP,
        "processes": n,
        "dtype": next(name for name, d in TORCH_DTYPES.items() if d == compute_dtype),
        "sizes_bytes": list(sizes),
        "kinds": kinds,
        "node_link": fit_node_link(n, sizes, all_reduce) if all_reduce else None,
    }


def measured_sync(n: int) -> dict:
    """{sync_cost_s, rank_variability}: what a collective costs these CPU ranks beyond its transfer when they arrive
    from computing on the cores they share, and how far apart they arrive (optimus.perf.rank_sync), each the
    largest any rank fitted."""
    measured, aligned = meetings()
    fitted_2 = torch.tensor(fit_sync(measured, aligned, n), dtype=torch.float64)
    dist.all_reduce(fitted_2, op=dist.ReduceOp.MAX)
    sync_cost, variability = fitted_2.tolist()
    return {"sync_cost_s": sync_cost, "rank_variability": variability}


def _timed(kind: Kind, sizes, dtype: torch.dtype, device: torch.device, reps: int) -> list[float]:
    """The slowest rank's median seconds of `kind` at each size."""
    mine = []
    for size in sizes:
        issue = kind.timed(dist.group.WORLD, size, dtype, device)
        mine.append(median_seconds(issue, device, reps, before=dist.barrier))
    slowest_S = torch.tensor(mine, dtype=torch.float64, device=device)
    dist.all_reduce(slowest_S, op=dist.ReduceOp.MAX)
    return slowest_S.tolist()


def fit_node_link(n: int, sizes, seconds: list[float]) -> dict | None:
    """{gbs, latency_us} of the link optimus.perf.costs needs to price the all-reduce as measured at the smallest
    and the largest size: the latency from the smallest, the bandwidth from the difference (as measure_gloo fits
    gloo's), or, where noise made the largest no slower, from the largest alone. None for one process, which
    has no link."""
    if n < 2:
        return None
    moved = 2 * (n - 1) / n
    steps = ring_steps("all_reduce", n)
    if seconds[-1] > seconds[0]:
        bandwidth = moved * (sizes[-1] - sizes[0]) / (seconds[-1] - seconds[0])
    else:
        bandwidth = moved * sizes[-1] / seconds[-1]
    return {"gbs": bandwidth / 1e9, "latency_us": seconds[0] / steps * 1e6}
