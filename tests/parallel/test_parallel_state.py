"""The DP x EP layout: rank coordinates, group membership, and the groups' collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optimus.config import ConfigError
from optimus.layout import Layout
from optimus.parallel.state import ParallelState, build_parallel_state
from tests.distributed import DistributedTestError, run_distributed


def test_rank_coordinates_put_ep_innermost():
    layout = Layout(world=8, ep=4)
    coords = [(layout.edp_rank(r), layout.ep_rank(r)) for r in range(8)]
    assert coords == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    ps = ParallelState(rank=5, layout=Layout(world=8, ep=4))
    assert ps.edp == 2 and ps.is_distributed and not ps.is_main


def test_single_process_state():
    ps = build_parallel_state(1)
    assert (ps.world_size, ps.ep, ps.edp, ps.rank) == (1, 1, 1, 0) and not ps.is_distributed
    with pytest.raises(ConfigError, match="parallel.ep=2 needs several processes"):
        build_parallel_state(2)


def layout_of_four(ep: int) -> dict:
    ps = build_parallel_state(ep, timeout_s=30)
    rank = dist.get_rank()
    one = torch.ones(1)
    ep_sum, edp_sum = torch.tensor([float(rank)]), torch.tensor([float(rank)])
    dist.all_reduce(ep_sum, group=ps.ep_group)
    dist.all_reduce(edp_sum, group=ps.edp_group)
    dist.all_reduce(one, group=ps.world_group)
    return {
        "coords": (ps.edp_rank, ps.ep_rank),
        "ep_ranks": dist.get_process_group_ranks(ps.ep_group),
        "edp_ranks": dist.get_process_group_ranks(ps.edp_group),
        "ep_sum": ep_sum.item(),
        "edp_sum": edp_sum.item(),
        "world": one.item(),
    }


@pytest.mark.slow
def test_groups_on_four_ranks():
    results = run_distributed(layout_of_four, 4, 2)
    assert [r["coords"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["ep_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["edp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["ep_sum"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r["edp_sum"] for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert all(r["world"] == 4.0 for r in results)


@pytest.mark.slow
def test_ep_that_does_not_divide_the_world_is_a_config_error():
    with pytest.raises(DistributedTestError, match="parallel.ep=3 does not divide the world size 4"):
        run_distributed(layout_of_four, 4, 3)
