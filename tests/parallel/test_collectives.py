"""Differentiable collectives against closed-form expectations, on real gloo process groups.

Every rank can compute what every other rank sends (inputs are seeded by rank), so
the expected outputs and gradients are written down directly from the definitions.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from optimus.parallel.collectives import (
    all_gather,
    all_gather_sizes,
    all_to_all,
    all_to_all_counts,
    reduce_scatter,
    reduce_scatter_sum,
)
from tests.distributed import DistributedTestError, run_distributed

D = 3


def rows_sent(src: int, dst: int) -> int:
    """Uneven, with zeros: rank 0 sends nothing to odd ranks, rank 1 sends nothing at all."""
    if src == 1:
        return 0
    if src == 0 and dst % 2:
        return 0
    return 1 + (src + 2 * dst) % 3


def block(src: int, dst: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + src * 10 + dst)
    return torch.randn(rows_sent(src, dst), D, generator=gen, dtype=torch.float64)


def check_all_to_all() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    in_rows = [rows_sent(rank, j) for j in range(world)]
    out_rows = [rows_sent(j, rank) for j in range(world)]
    x = torch.cat([block(rank, j, seed=0) for j in range(world)]).requires_grad_(True)
    y = all_to_all(x, out_rows, in_rows, None)
    torch.testing.assert_close(y, torch.cat([block(j, rank, seed=0) for j in range(world)]), rtol=0, atol=0)
    # loss_r = <y_r, g_r>; the gradient of the rows we sent to j is g_j's block from us.
    (y * torch.cat([block(j, rank, seed=1) for j in range(world)])).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([block(rank, j, seed=1) for j in range(world)]), rtol=0, atol=0)

    counts = torch.tensor([[rank * 10 + j, rank] for j in range(world)])  # row j goes to rank j
    expected = torch.tensor([[j * 10 + rank, j] for j in range(world)])
    assert torch.equal(all_to_all_counts(counts, None), expected)
    assert all_gather_sizes(rank + 5, torch.device("cpu"), None) == [r + 5 for r in range(world)]


def per_rank(seed: int, rank: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(rows, D, generator=gen, dtype=torch.float64)


def check_gather_and_reduce_scatter() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 2
    x = per_rank(0, rank, n).requires_grad_(True)
    y = all_gather(x, None)
    torch.testing.assert_close(y, torch.cat([per_rank(0, j, n) for j in range(world)]), rtol=0, atol=0)
    # Every rank's loss reads our block: our gradient is the sum of their weights on it.
    (y * per_rank(1, rank, world * n)).sum().backward()
    expected = sum(per_rank(1, j, world * n)[rank * n : (rank + 1) * n] for j in range(world))
    torch.testing.assert_close(x.grad, expected)

    z = per_rank(2, rank, world * n).requires_grad_(True)
    out = reduce_scatter(z, None)
    expected = sum(per_rank(2, j, world * n)[rank * n : (rank + 1) * n] for j in range(world))
    torch.testing.assert_close(out, expected)
    # Our block of z feeds rank j's output block j: its gradient is rank j's weights.
    (out * per_rank(3, rank, n)).sum().backward()
    torch.testing.assert_close(z.grad, torch.cat([per_rank(3, j, n) for j in range(world)]), rtol=0, atol=0)


def check_subgroup() -> None:
    """Collectives on a subgroup: ranks {0, 2} and {1, 3} each gather only among themselves."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    y = all_gather(torch.tensor([[float(rank)]]), group)
    assert y.flatten().tolist() == [float(rank % 2), float(rank % 2 + 2)]
    out = reduce_scatter(torch.tensor([[1.0], [2.0]]) * (rank + 1), group)
    members = [rank % 2, rank % 2 + 2]
    assert out.item() == sum(m + 1 for m in members) * (1.0 if rank < 2 else 2.0)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_uneven_with_empty_sends(world):
    run_distributed(check_all_to_all, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_and_reduce_scatter_are_adjoint(world):
    run_distributed(check_gather_and_reduce_scatter, world)


@pytest.mark.slow
def test_collectives_on_subgroups():
    run_distributed(check_subgroup, 4)


def _summed_blocks() -> list[bool]:
    """reduce_scatter_sum, waited at once and in flight beside another, against the sum of every rank's input."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = [torch.randn(world * 6, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    expected = torch.stack(inputs).sum(0).view(world, 6)[rank]
    out_sync, out_a, out_b = torch.empty(6), torch.empty(6), torch.empty(6)
    reduce_scatter_sum(out_sync, inputs[rank].clone(), dist.group.WORLD)
    first = reduce_scatter_sum(out_a, inputs[rank].clone(), dist.group.WORLD, async_op=True)
    second = reduce_scatter_sum(out_b, 2 * inputs[rank], dist.group.WORLD, async_op=True)
    second.wait()
    first.wait()
    return [torch.allclose(out, want) for out, want in ((out_sync, expected), (out_a, expected), (out_b, 2 * expected))]


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_sum_is_this_ranks_block_of_the_sum(world):
    """On gloo the optimizer's and the all-gather dispatcher's reduce-scatter is an all-to-all and a local sum."""
    assert all(all(ok) for ok in run_distributed(_summed_blocks, world))


def _indivisible() -> None:
    reduce_scatter(torch.zeros(3, D), None)


def test_reduce_scatter_rejects_indivisible_rows():
    # Also checks that the helper re-raises a child's exception with its message.
    with pytest.raises(DistributedTestError, match="divisible by the group size 2"):
        run_distributed(_indivisible, 2)


# ---- the test helper itself: failures other tests rely on it to report ---------------------


def _exit_without_reporting() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return 0


def _hang() -> None:
    time.sleep(60)


def test_helper_reports_a_rank_that_exits_silently():
    with pytest.raises(DistributedTestError, match="rank 1 exited with code 3"):
        run_distributed(_exit_without_reporting, 2)


def test_helper_kills_ranks_past_the_deadline():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 0 was killed or timed out"):
        run_distributed(_hang, 2, timeout_s=2)
    assert time.monotonic() - start < 30


def bf16_sums() -> list[torch.Tensor]:
    """reduce_scatter (and all_gather's backward, a reduce-scatter) of bf16 rows from 4 ranks."""
    rank = dist.get_rank()
    # Rank 0 sends 1.0, the others 2^-8 each: in bf16 (8 significant bits) every partial sum
    # 1 + 2^-8 rounds back to 1.0, while the exact sum 1 + 3 * 2^-8 rounds to 1.015625.
    x = torch.full((4, 2), 1.0 if rank == 0 else 2.0**-8, dtype=torch.bfloat16)
    forward = reduce_scatter(x, dist.group.WORLD)
    leaf = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    (all_gather(leaf, dist.group.WORLD) * x).sum().backward()
    return [forward, leaf.grad]


def test_bf16_sums_over_ranks_round_once():
    """A sum over ranks is accumulated in fp32 and rounded once, not rounded after every partial sum."""
    exact = torch.tensor(1.0 + 3 * 2.0**-8).to(torch.bfloat16)
    for forward, backward in run_distributed(bf16_sums, 4):
        assert forward.dtype == backward.dtype == torch.bfloat16
        assert torch.all(forward == exact) and torch.all(backward == exact), (forward, backward)
