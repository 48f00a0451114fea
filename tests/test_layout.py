"""The rank layout (optimus.layout): its degrees, a rank's coordinates and its groups against the brute-force
definition - a group of a kind is the ranks that share every coordinate but the kind's own."""

from __future__ import annotations

import itertools

import pytest

from optimus.errors import ConfigError
from optimus.layout import Layout

LAYOUTS = [
    Layout(world=8, ep=4),
    Layout(world=12, pp=2, ep=3),
    Layout(world=16, pp=2, tp=2, ep=4, sp=True),
    Layout(world=24, pp=3, tp=4, ep=2),
    Layout(world=6),
]


def coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """Rank r's coordinates written from the definition: r = (pp_rank x S + dp_rank x tp + tp_rank) for the dense
    layers, (pp_rank x S + edp_rank x ep + ep_rank) for the MoE layers, S = world / pp."""
    stage_size = layout.world // layout.pp
    pp_rank, in_stage = divmod(rank, stage_size)
    dp_rank, tp_rank = divmod(in_stage, layout.tp)
    edp_rank, ep_rank = divmod(in_stage, layout.ep)
    return {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank, "edp": edp_rank, "ep": ep_rank}


# Each kind of group: the coordinates its members share.
SHARED = {
    "tp_groups": ("pp", "dp"),
    "dp_groups": ("pp", "tp"),
    "ep_groups": ("pp", "edp"),
    "edp_groups": ("pp", "ep"),
    "stage_groups": ("pp",),
    "pp_groups": ("dp", "tp"),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_degrees_and_coordinates_follow_the_definition(layout):
    assert layout.stage_size * layout.pp == layout.world
    assert layout.dp * layout.tp == layout.edp * layout.ep == layout.stage_size
    for rank in range(layout.world):
        expected = coordinates(layout, rank)
        got = {"pp": layout.pp_rank(rank), "dp": layout.dp_rank(rank), "tp": layout.tp_rank(rank),
               "edp": layout.edp_rank(rank), "ep": layout.ep_rank(rank)}  # fmt: skip
        assert got == expected


@pytest.mark.parametrize("kind", SHARED)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_groups_are_the_ranks_that_share_the_other_coordinates(layout, kind):
    groups = getattr(layout, kind)()
    assert sorted(r for g in groups for r in g) == list(range(layout.world))  # a partition of the world
    key = {rank: tuple(coordinates(layout, rank)[c] for c in SHARED[kind]) for rank in range(layout.world)}
    expected = {}
    for rank in range(layout.world):
        expected.setdefault(key[rank], []).append(rank)
    assert sorted(groups) == sorted(expected.values())


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_an_ep_group_and_an_edp_group_share_one_rank(layout):
    for ep_group, edp_group in itertools.product(layout.ep_groups(), layout.edp_groups()):
        same_stage = layout.pp_rank(ep_group[0]) == layout.pp_rank(edp_group[0])
        assert len(set(ep_group) & set(edp_group)) == (1 if same_stage else 0)


def test_one_stage_and_the_residual_stream():
    layout = Layout(world=16, pp=2, tp=2, ep=4, sp=True)
    stage = layout.one_stage()
    assert (stage.world, stage.pp, stage.tp, stage.ep, stage.dp, stage.edp) == (8, 1, 2, 4, 4, 2)
    assert layout.residual_seq_len(64) == 32
    assert Layout(world=2, tp=2, sp=False).residual_seq_len(64) == 64
    assert not Layout(world=2, sp=True).sp  # nothing to split the sequence over without tp


def test_micro_batches_and_their_refusal():
    assert Layout(world=16, pp=2, tp=2).micro_batches(64, 2) == 64 // (2 * 4)
    with pytest.raises(
        ConfigError, match=r"micro_batch x data-parallel ranks = 2 x 4: make global_batch a multiple of 8"
    ):
        Layout(world=16, pp=2, tp=2).micro_batches(12, 2)
    with pytest.raises(ConfigError, match=r"x world size / parallel.tp = 2 x 4"):
        Layout(world=8, tp=2).micro_batches(12, 2)


def test_a_layout_is_frozen():
    with pytest.raises(AttributeError):
        Layout(world=4).world = 8


HIERARCHICAL = [
    Layout(world=8, ep=2, shard_ranks=2),
    Layout(world=16, pp=2, tp=2, ep=2, shard_ranks=2),
    Layout(world=8, ep=4, shard_ranks=1),
    Layout(world=12, ep=3, shard_ranks=4),
]


@pytest.mark.parametrize("layout", HIERARCHICAL, ids=str)
def test_shard_and_replica_groups_cut_each_shard_world_by_position(layout):
    """optim.shard_ranks = S: in each data-parallel and expert-data-parallel group, positions p and q share a shard
    group when p // S == q // S (consecutive members) and a replica group when p % S == q % S."""
    s = layout.shard_ranks
    for worlds in (layout.dp_groups(), layout.edp_groups()):
        shards, replicas = layout.shard_groups(worlds), layout.replica_groups(worlds)
        for groups in (shards, replicas):
            assert sorted(r for g in groups for r in g) == list(range(layout.world))  # a partition of the world
        for world in worlds:
            for p, rank in enumerate(world):
                (shard,) = [g for g in shards if rank in g]
                (replica,) = [g for g in replicas if rank in g]
                assert shard == [r for q, r in enumerate(world) if q // s == p // s]
                assert replica == [r for q, r in enumerate(world) if q % s == p % s]
                assert layout.shard_place(p, len(world)) == (replica.index(rank), shard.index(rank))
                assert layout.shard_replicas(len(world)) == len(replica)


def test_without_shard_ranks_a_shard_group_is_the_whole_group():
    layout = Layout(world=8, ep=2)
    assert layout.shard_groups(layout.edp_groups()) == layout.edp_groups()
    assert layout.replica_groups(layout.edp_groups()) == [[r] for g in layout.edp_groups() for r in g]
    assert layout.one_stage() is layout and Layout(world=8, pp=2, shard_ranks=2).one_stage().shard_ranks == 2
