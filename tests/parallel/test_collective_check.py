"""The start-up check of the collectives: it passes on a sound backend over every group of a layout, and a
collective that returns wrong values on one rank stops every rank with the same one-sentence error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optimus.parallel import build_parallel_state
from optimus.parallel.collective_check import CollectiveCheckFailed, check_collectives, checks
from tests.distributed import run_distributed


def _check(
    ep: int, pp: int, tp: int, dispatcher: str, dtype: torch.dtype, corrupt_rank: int | None = None,
    shard_ranks: int | None = None,
):  # fmt: skip
    """Build the layout's groups (with optim.shard_ranks) and run the check; `corrupt_rank` gets an
    all_to_all_single that swaps two received rows (a backend bug that keeps shapes and hangs nothing). Returns the
    sentence raised, or None."""
    if dist.get_rank() == corrupt_rank:
        exchange = dist.all_to_all_single

        def corrupted(output, input, *args, **kwargs):
            work = exchange(output, input, *args, **kwargs)
            if output.shape[0] > 1:
                output[[0, 1]] = output[[1, 0]].clone()
            return work

        dist.all_to_all_single = corrupted
    ps = build_parallel_state(ep, 60.0, pp, tp, "cpu", True, shard_ranks=shard_ranks)
    try:
        check_collectives(ps, torch.device("cpu"), dtype, dispatcher)
    except CollectiveCheckFailed as err:
        return str(err)
    return None


@pytest.mark.parametrize(
    "ep, pp, tp, dispatcher, dtype, shard_ranks",
    [
        (2, 2, 1, "alltoall", torch.bfloat16, None),
        (4, 1, 2, "alltoall", torch.float32, None),
        (2, 1, 1, "allgather", torch.bfloat16, 2),  # and the shard and replica groups of hierarchical sharding
    ],
)
def test_a_sound_backend_passes_on_every_group(ep, pp, tp, dispatcher, dtype, shard_ranks, single_threaded):
    assert run_distributed(_check, 4, ep, pp, tp, dispatcher, dtype, None, shard_ranks) == [None] * 4


def test_a_corrupting_all_to_all_on_one_rank_stops_every_rank_with_one_sentence(single_threaded):
    sentences = run_distributed(_check, 4, 2, 1, 1, "alltoall", torch.bfloat16, 3)
    expected = (
        "all_to_all of token counts in int64 over the EP group returned wrong values on the gloo backend at "
        "start-up; use parallel.dispatcher=allgather (an all-gather and a reduce-scatter instead of the "
        "all-to-all), or set parallel.check_collectives=false to train anyway."
    )
    assert sentences == [expected] * 4


def test_every_rank_lists_the_same_checks_whatever_its_groups():
    """The failure vector is reduced element by element: its order cannot depend on the rank's place."""
    from optimus.layout import Layout
    from optimus.parallel.state import ParallelState

    a = [
        (c.name, c.group_field, c.dtype)
        for c in checks(ParallelState(rank=0, layout=Layout(world=8, ep=2, pp=2)), torch.bfloat16, "alltoall")
    ]
    b = [
        (c.name, c.group_field, c.dtype)
        for c in checks(ParallelState(rank=7, layout=Layout(world=8, ep=2, pp=2)), torch.bfloat16, "alltoall")
    ]
    assert a == b
    assert ("all_to_all with uneven splits", "ep_group", torch.bfloat16) in a
    assert ("send/recv between stages", "pp_group", torch.bfloat16) in a
    assert ("all_reduce", "dp_replica_group", torch.bfloat16) in a  # optim.shard_ranks' (none here: not run)
