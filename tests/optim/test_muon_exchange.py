"""Muon's whole-matrix ownership (optimus.optim.muon_exchange) on real all-to-alls over gloo.

Every element's direction is its own flat index, so what each owner assembles and what each holder gets back
can be checked element by element against the flat layout: random parameter shapes (expert tensors, matrices,
vectors), bucket sizes that cut units across buckets and slices or leave them whole, 1 to 4 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optimus.layout import Layout
from optimus.optim.memory import MUON_DIRECTION_BYTES, muon_group_work_bytes
from optimus.optim.muon import batch_shapes, muon_slots_of
from optimus.optim.muon_exchange import MuonExchange, every_ranks_work, units_of
from optimus.optim.muon_plan import planned_muon_step_bytes
from optimus.parallel.flat_buffer import FlatParams
from tests.distributed import run_distributed


def random_params(seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)

    def size(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    e, d, f = size(1, 5), size(4, 40), size(2, 30)
    shapes = {
        "layers.0.attn.wq.weight": (size(4, 60), d), "layers.0.attn_norm.weight": (d,),
        "layers.0.ffn.experts.w13": (e, d, 2 * f), "layers.0.ffn.experts.w2": (e, f, d),
        "layers.0.ffn.router.gate.weight": (e, d), "layers.1.ffn.w2.weight": (d, size(4, 80)),
    }  # fmt: skip
    return [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in shapes.items()]


def exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    received = send.new_empty(sum(recv_counts))
    dist.all_to_all_single(received, send, recv_counts, send_counts)
    return received


def _round_trip(cases: list[tuple[int, int]]) -> list[dict]:
    """Rank body: per (seed, bucket elements), gather the units this rank owns from everyone's shard, check them,
    scatter their negation back; return the units owned and the elements received."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for seed, bucket in cases:
        flat = FlatParams(random_params(seed), world, rank, bucket)
        plan = MuonExchange(flat, muon_slots_of(flat))
        index = torch.arange(flat.padded_numel, dtype=torch.float32)  # [N_pad]: each element's direction
        shard = torch.empty(flat.shard_numel)
        for b in flat.buckets:
            flat.shard_view(shard, b).copy_(flat.owned_view(index, b))
        units = plan.gather(shard, exchange)
        for u in plan.owned:
            assert torch.equal(units[u.buf_lo : u.buf_lo + u.numel], index[u.lo : u.hi]), (seed, bucket, u.slot.name)
        back = torch.full_like(shard, float("nan"))
        plan.scatter(-units, back, exchange)
        want = torch.full_like(index, float("nan"))
        for s in plan.slots:
            want[s.start : s.end] = -index[s.start : s.end]  # Muon's elements come back negated, nothing else
        for b in flat.buckets:
            got, expected = flat.shard_view(back, b), flat.owned_view(want, b)
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
        owned = [(u.slot.name, u.index) for u in plan.owned]
        out.append({"owned": owned, "received": plan.received_numel(), "crosses": plan.crosses})
    return out


CASES = [(seed, bucket) for seed in range(4) for bucket in (2**62, 512, 96)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_owners_assemble_their_units_and_return_every_update(world):
    per_rank = run_distributed(_round_trip, world, CASES)
    for i, (seed, bucket) in enumerate(CASES):
        flat = FlatParams(random_params(seed), 1, 0, bucket)
        every_unit = sorted((s.name, j) for s in muon_slots_of(flat) for j in range(len(units_of(s))))
        owned = sorted(key for r in per_rank for key in r[i]["owned"])
        assert owned == every_unit, (seed, bucket)  # each unit has exactly one owner
        if world == 1:
            assert per_rank[0][i]["received"] == 0 and not per_rank[0][i]["crosses"]
        assert len({r[i]["crosses"] for r in per_rank}) == 1  # every rank agrees whether to exchange
    if world > 1:  # the cases exercise the exchanges
        assert sum(r["received"] for rank in per_rank for r in rank) > 0


def test_units_smaller_than_a_slice_stay_where_they_are():
    """With one bucket, units far smaller than a rank's slice: only those straddling a slice boundary travel, so
    each rank receives less than a tenth of its shard, where an all-gather of directions brings it the rest."""

    def received(rank: int, world: int) -> tuple[int, int]:
        named = [(f"layers.{i}.attn.wq.weight", torch.nn.Parameter(torch.zeros(16, 16))) for i in range(64)]
        flat = FlatParams(named, world, rank, 2**62)
        return MuonExchange(flat, muon_slots_of(flat)).received_numel(), flat.shard_numel

    for rank in range(4):
        got, shard = received(rank, 4)
        assert got < shard / 10, (rank, got, shard)


def plans(named: list, world: int, bucket: int) -> list[MuonExchange]:
    """Every rank's plan of one layout, built in this process (the plan needs no communication)."""
    out = []
    for rank in range(world):
        flat = FlatParams(named, world, rank, bucket)
        out.append(MuonExchange(flat, muon_slots_of(flat)))
    return out


def test_units_that_cover_several_slices_take_turns():
    """Sixteen 64 x 64 matrices in buckets of one matrix each, over 8 ranks: every rank's slice holds an eighth
    of every matrix. Choosing by a fixed position (the middle element) would give all sixteen to one rank; the
    least-loaded rule gives two to each."""
    named = [(f"layers.{i}.attn.wq.weight", torch.nn.Parameter(torch.zeros(64, 64))) for i in range(16)]
    owned = [len(p.owned) for p in plans(named, 8, 64 * 64)]
    assert owned == [2] * 8


@pytest.mark.parametrize("seed", range(6))
def test_every_ranks_work_is_each_ranks_own_plan(seed):
    """`optimus plan`'s sizing of a Muon step (every_ranks_work, one pass over the units) against each rank's own
    exchange plan (the units it owns, the pieces it sends and receives), for random shapes, worlds and bucket
    sizes (units within slices, across slices, across buckets); and planned_muon_step_bytes is the busiest
    rank's figure, with the attention matrix counted as split by tensor parallelism."""
    g = torch.Generator().manual_seed(100 + seed)
    named = random_params(seed)
    tp, split_dims = 2, {"layers.0.attn.wq.weight": 0}
    for world in (2, 3, 4, 8):
        for bucket in (2**62, int(torch.randint(64, 4000, (1,), generator=g))):
            every = plans(named, world, bucket)
            sized = every_ranks_work(every[0].flat, every[0].slots)
            assert [[(u.slot.name, u.index) for u in r.owned] for r in sized] == [
                [(u.slot.name, u.index) for u in p.owned] for p in every
            ], (world, bucket)
            assert [r.received for r in sized] == [p.received_numel() for p in every], (world, bucket)
            work = received = 0
            for p in every:  # each rank's own figures, from its own plan
                split = sum(u.numel for u in p.owned if u.slot.name in split_dims)
                batches = batch_shapes(p.owned, lambda slot: split_dims.get(slot.name), tp)
                figures = (p.flat.shard_numel, p.buf_numel, p.received_numel(), split, tp, batches, 2)
                work = max(work, muon_group_work_bytes(*figures))
                received = max(received, (p.received_numel() + (tp - 1) * split) * MUON_DIRECTION_BYTES)
            shapes = {"dense": [(n, tuple(q.shape)) for n, q in named]}
            stage = Layout(world=world * tp, tp=tp)  # ep_aware: the dense group's owners are the tp rank's peers
            planned = planned_muon_step_bytes(
                shapes, "ep_aware", stage, torch.float32, bucket, split_dims, torch.bfloat16
            )
            assert planned == (work, received), (world, bucket)
