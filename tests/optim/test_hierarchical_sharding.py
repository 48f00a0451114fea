"""Hierarchical sharding (optim.shard_ranks): the collectives one step issues, and who counts a shard in the norm.

On 4 ranks with shard_ranks=2 the state of both groups is split inside shard groups {0, 1} and {2, 3} and each
shard is replicated in replica groups {0, 2} and {1, 3} (optimus.layout). A step must reduce-scatter each bucket
inside the shard group, in optim.grad_dtype, all-reduce that shard (half the bucket) over the replica group,
gather the updated parameters inside the shard group, and span all 4 ranks only with the gradient norm's fp64
sum. And for pipeline and tensor-parallel layouts too large to run here, every rank's choice of groups: each shard
counted in the norm by one rank. (That the values are right is tests/optim/test_sharded_optimizer.py's and
test_muon.py's.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from optimus.config import ParallelConfig
from optimus.layout import Layout
from optimus.optim import ShardedAdamW, ShardedMuon
from optimus.optim.sharder import group_comms
from optimus.parallel import ParallelState, build_parallel_state, parallelize_model
from optimus.parallel.collective_trace import CollectiveTrace
from tests.distributed import run_distributed
from tests.optim.test_sharded_optimizer import GRAD_CLIP, batches, loss_of, new_model, optim_cfg

REDUCE_SCATTERS = ("reduce_scatter", "all_to_all")  # gloo's reduce-scatter is an all-to-all (reduce_scatter_sum)


def one_traced_step(layouts: list[tuple[int, str]]) -> list[dict]:
    """Body: per (ZeRO stage, update rule), one step of 2 micro-batches per rank under the collective trace."""
    out = []
    for zero, update in layouts:
        ps = build_parallel_state(1, shard_ranks=2)
        model = new_model()
        parallelize_model(model, ps, ParallelConfig())
        cfg = dataclasses.replace(optim_cfg(zero, bucket_mb=0.02, max_numel=3000, grad_dtype="bf16"), update=update)
        optimizer = (ShardedMuon if update == "muon" else ShardedAdamW)(
            model, cfg, ps, GRAD_CLIP, "ep_aware", micro_batches=2
        )
        trace = CollectiveTrace()
        with trace:
            for mb in batches()[0, 2 * ps.rank : 2 * ps.rank + 2]:
                (loss_of(model, mb, 2) / 2).backward()
            optimizer.step(1e-3)
        buckets = sum(len(g.flat.buckets) for g in optimizer.sharder.groups.values())
        plans = optimizer.rule._exchanges.values() if update == "muon" else []
        exchanges = sum(2 for plan in plans if plan is not None and plan.crosses)  # gather and scatter, per group
        out.append({"calls": trace.calls, "buckets": buckets, "exchanges": exchanges, "rank": dist.get_rank()})
    return out


def test_a_step_reduces_inside_the_shard_group_and_over_the_replicas():
    layouts = [(1, "adamw"), (2, "adamw"), (2, "muon")]
    per_rank = run_distributed(one_traced_step, 4, layouts, timeout_s=300)
    for i, (zero, update) in enumerate(layouts):
        for result in (r[i] for r in per_rank):
            rank, calls, where = result["rank"], result["calls"], f"zero={zero} {update}"
            shard, replicas = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
            grads = [c for c in calls if c["op"] in REDUCE_SCATTERS and c["dtype"] == "bfloat16"]
            sums = [c for c in calls if c["op"] == "all_reduce" and c["dtype"] == "bfloat16"]
            assert len(grads) == len(sums) == result["buckets"], where
            assert all(c["ranks"] == shard for c in grads), where
            assert all(c["ranks"] == replicas for c in sums), where
            # each its bucket's shard (under ZeRO-2 the two groups' buckets interleave in the backward)
            assert sorted(c["bytes"] for c in sums) == sorted(c["bytes"] // 2 for c in grads), where
            # Muon's exchanges (fp32 all-to-alls) and the parameters' all-gathers stay in the shard group too.
            assert all(c["ranks"] == shard for c in calls if c["op"] in (*REDUCE_SCATTERS, "all_gather")), where
            assert sum(c["op"] == "all_gather" for c in calls) == result["buckets"], where
            muon = [c for c in calls if c["op"] == "all_to_all" and c["dtype"] == "float32"]
            assert len(muon) == result["exchanges"] and (update == "adamw" or muon), where
            world = [c for c in calls if c["ranks"] == [0, 1, 2, 3]]
            assert [(c["op"], c["dtype"]) for c in world] == [("all_reduce", "float64")], where  # the norm


@pytest.mark.parametrize("scheme", ["ep_aware", "standard"])
@pytest.mark.parametrize(
    "layout",
    [
        Layout(world=16, pp=2, tp=2, ep=2, shard_ranks=2),
        Layout(world=8, ep=2, shard_ranks=2),
        Layout(world=8, ep=4, shard_ranks=1),
    ],
    ids=str,
)
def test_each_shard_is_counted_in_the_norm_by_one_rank(layout, scheme):
    """Every rank's GroupComm (the choice is arithmetic: built here without process groups): each group's state is
    split over shard_ranks ranks, and every shard of the same elements (dense: a stage's tp rank's slices, which
    standard's EP ranks with tp = 1 all hold; experts: an EP rank's) is counted in the norm by exactly one rank."""
    counters: dict[tuple, list[int]] = {}
    for rank in range(layout.world):
        ps = ParallelState(rank=rank, layout=layout).stage()
        comms = group_comms(ps, scheme)
        for kind, comm in comms.items():
            assert comm.shard_world == layout.shard_ranks
            place = ps.ep_rank if kind == "expert" else ps.tp_rank
            key = (kind, layout.pp_rank(rank), place, comm.shard_rank)
            counters.setdefault(key, [])
            if comm.counts_in_norm:
                counters[key].append(rank)
    shards = layout.pp * (layout.ep + layout.tp) * layout.shard_ranks  # (stage, ep or tp rank, shard rank)
    assert len(counters) == shards and all(len(ranks) == 1 for ranks in counters.values()), counters
