"""Check at start that the backend computes the collectives the step uses, on the real groups, correctly.

Backends are not equally sound: on XCCL, `all_to_all_single` with unequal splits is emulated with
send/recv, and data corruption in it has been worked around by other projects; a wrong all-to-all does
not hang, it trains on wrong tokens. Before step 1 every rank runs each collective kind the step issues
once on small tensors, on each of its groups, in each dtype the step moves, through the same functions
the step calls (`optimus.parallel.collectives`), and compares the result with values every rank can
compute. Each input element has exactly one contributing rank, so every sum is exact in any dtype.

The ranks then agree (one all-reduce of a failure vector over the world) and every rank raises the same
one-sentence `CollectiveCheckFailed` naming the first failing collective, its group and the backend, with
the documented alternative. `parallel.check_collectives=false` skips the check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optimus.config import ConfigError
from optimus.parallel.collectives import _all_gather_tensor, reduce_scatter_sum
from optimus.parallel.state import ParallelState

WIDTH = 4  # elements per row; small: the check moves a few KB per group


class CollectiveCheckFailed(ConfigError):
    """A collective returned wrong values on this backend: the run stops before step 1, and the fix is a
    setting (another dispatcher), so it is reported like a config error, in one sentence."""


@dataclass(frozen=True)
class Check:
    """One collective kind on one of a rank's groups in one dtype; every rank lists the same kinds in order."""

    name: str  # e.g. "all_to_all with uneven splits"
    group_field: str  # the ParallelState field holding the group
    dtype: torch.dtype
    run: Callable[[object, torch.dtype, torch.device], bool]  # (group, dtype, device) -> values correct
    alternative: str  # what to set instead when it fails


def _members(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _marked(contributor: int, size: int, n: int, dtype, device) -> torch.Tensor:
    """[n] values that member `contributor` of `size` adds: element k is (k % 50) + 1 if k % size is it, else 0."""
    k = torch.arange(n, device=device)
    return torch.where(k % size == contributor, k % 50 + 1, 0).to(dtype)


def _check_all_reduce(group, dtype, device) -> bool:
    me, size = _members(group)
    n = min(size, 64) * WIDTH
    x = _marked(me, size, n, dtype, device)
    dist.all_reduce(x, group=group)
    return torch.equal(x, sum(_marked(r, size, n, dtype, device) for r in range(min(size, n))))


def _rows(src: int, dst: int, n: int, dtype, device) -> torch.Tensor:
    """[n, WIDTH] rows that member `src` sends to member `dst`: small integers, exact in bf16."""
    i = torch.arange(n * WIDTH, device=device).view(n, WIDTH)
    return ((src * 7 + dst * 3 + i) % 61).to(dtype)


def _uneven(src: int, dst: int) -> int:
    return (src + 2 * dst) % 3 + 1  # 1 to 3 rows: splits that differ by pair and direction


def _check_all_to_all(group, dtype, device) -> bool:
    me, size = _members(group)
    send = torch.cat([_rows(me, j, _uneven(me, j), dtype, device) for j in range(size)])
    recv_rows = [_uneven(j, me) for j in range(size)]
    received = send.new_empty((sum(recv_rows), WIDTH))
    dist.all_to_all_single(received, send, recv_rows, [_uneven(me, j) for j in range(size)], group=group)
    expected = torch.cat([_rows(j, me, _uneven(j, me), dtype, device) for j in range(size)])
    return torch.equal(received, expected)


def _check_all_gather(group, dtype, device) -> bool:
    me, size = _members(group)
    out = torch.empty((size * 2, WIDTH), dtype=dtype, device=device)
    _all_gather_tensor(out, _rows(me, 0, 2, dtype, device), group=group)
    return torch.equal(out, torch.cat([_rows(j, 0, 2, dtype, device) for j in range(size)]))


def _block(b: int, dtype, device) -> torch.Tensor:
    """[WIDTH] non-zero values of block b, different for neighbouring blocks, exact in bf16."""
    return ((torch.arange(WIDTH, device=device) + b) % 50 + 1).to(dtype)


def _check_reduce_scatter(group, dtype, device) -> bool:
    me, size = _members(group)
    # Block b of every member's buffer: only member (b + 1) % size contributes, so the sum is exact.
    src = torch.cat([_block(b, dtype, device) * (me == (b + 1) % size) for b in range(size)])
    out = torch.empty(WIDTH, dtype=dtype, device=device)
    reduce_scatter_sum(out, src, group)
    return torch.equal(out, _block(me, dtype, device))


def _check_neighbours(group, dtype, device) -> bool:
    """The pipeline's pattern: every member sends to the next and receives from the previous at once."""
    me, size = _members(group)
    nxt, prev = (me + 1) % size, (me - 1) % size
    received = torch.empty((2, WIDTH), dtype=dtype, device=device)
    ops = [
        dist.P2POp(dist.isend, _rows(me, nxt, 2, dtype, device), dist.get_global_rank(group, nxt), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, prev), group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return torch.equal(received, _rows(prev, me, 2, dtype, device))


_USE_ALLGATHER = "parallel.dispatcher=allgather (an all-gather and a reduce-scatter instead of the all-to-all)"
_NO_FIX = "a backend that computes it correctly (report it to the backend's maintainers)"


def checks(ps: ParallelState, compute_dtype: torch.dtype, dispatcher: str) -> list[Check]:
    """The collective kinds the step issues, per group and dtype, in the same order on every rank."""
    dtypes = list(dict.fromkeys([compute_dtype, torch.float32]))
    found = [Check("all_reduce", "world_group", torch.float32, _check_all_reduce, _NO_FIX)]
    found.append(Check("all_reduce", "world_group", torch.float64, _check_all_reduce, _NO_FIX))  # the grad norm
    if ps.ep > 1 and dispatcher == "alltoall":
        found.append(Check("all_to_all of token counts", "ep_group", torch.int64, _check_all_to_all, _USE_ALLGATHER))
        found += [
            Check("all_to_all with uneven splits", "ep_group", d, _check_all_to_all, _USE_ALLGATHER) for d in dtypes
        ]
    if ps.ep > 1 and dispatcher == "allgather":
        found += [Check("all_gather", "ep_group", d, _check_all_gather, _NO_FIX) for d in dtypes]
        found += [Check("reduce_scatter", "ep_group", d, _check_reduce_scatter, _NO_FIX) for d in dtypes]
    # The optimizer's shard groups (the stage's ranks, the experts' data-parallel ranks, with tp the dense
    # replicas) and the tp group of the DTensor layers.
    stage = "world_group" if ps.pp == 1 else "stage_group"
    for field in (stage, "edp_group", "dense_dp_group", "tp_group", "dp_shard_group", "edp_shard_group"):
        found += [Check("reduce_scatter", field, d, _check_reduce_scatter, _NO_FIX) for d in dtypes]
        found += [Check("all_gather", field, d, _check_all_gather, _NO_FIX) for d in dtypes]
    # optim.shard_ranks: each shard's sum over the shard groups (none where the field is unset)
    for field in ("dp_replica_group", "edp_replica_group"):
        found += [Check("all_reduce", field, d, _check_all_reduce, _NO_FIX) for d in dtypes]
    found += [Check("all_reduce", "tp_group", d, _check_all_reduce, _NO_FIX) for d in dtypes]
    found += [Check("send/recv between stages", "pp_group", d, _check_neighbours, _NO_FIX) for d in dtypes]
    return found


def _group(ps: ParallelState, field: str):
    group = getattr(ps, field)
    if field == "world_group" and group is None:
        group = dist.group.WORLD
    return group if group is not None and dist.get_world_size(group) > 1 else None


def check_collectives(ps: ParallelState, device: torch.device, compute_dtype: torch.dtype, dispatcher: str) -> None:
    """Run every check on this rank's groups; all ranks raise the first failure, or none does."""
    if not ps.is_distributed:
        return
    listed = checks(ps, compute_dtype, dispatcher)
    failed_C = torch.zeros(len(listed), dtype=torch.float32, device=device)
    for i, check in enumerate(listed):
        group = _group(ps, check.group_field)
        if group is not None and not check.run(group, check.dtype, device):
            failed_C[i] = 1
    dist.all_reduce(failed_C, op=dist.ReduceOp.MAX)
    if failed_C.any():
        first = listed[int(failed_C.nonzero()[0])]
        backend = dist.get_backend()
        group_name = first.group_field.removesuffix("_group").upper()
        raise CollectiveCheckFailed(
            f"{first.name} in {str(first.dtype).removeprefix('torch.')} over the {group_name} group returned wrong "
            f"values on the {backend} backend at start-up; use {first.alternative}, or set "
            "parallel.check_collectives=false to train anyway."
        )
