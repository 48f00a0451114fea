"""What one Muon step holds and receives on the busiest rank of a layout, computed before a run from the
parameters' shapes alone, by the code the run executes: FlatParams cuts the group's flat buffer and buckets from
meta tensors (no memory, milliseconds), and the ownership rule of optimus.optim.muon_exchange places every unit
of work on every rank of the shard group in one pass. `optimus plan` prices the step with it (optimus.plan); a
run reports its own rank's figures from the same arithmetic (Muon.step_bytes, with
optimus.optim.memory.muon_group_work_bytes saying what is held).
"""

from __future__ import annotations

import torch

from optimus.layout import Layout
from optimus.optim.memory import MUON_DIRECTION_BYTES, muon_group_work_bytes, shard_worlds
from optimus.optim.muon import batch_shapes, muon_slots_of
from optimus.optim.muon_exchange import every_ranks_work
from optimus.parallel.flat_buffer import FlatParams

# One optimizer group's parameters as a rank holds them, in model order: (name, local shape).
NamedShapes = list[tuple[str, tuple[int, ...]]]


def planned_muon_step_bytes(
    groups: dict[str, NamedShapes], scheme: str, stage: Layout, dtype: torch.dtype, bucket: int,
    tp_split: dict[str, int], ns_dtype: torch.dtype,
) -> tuple[int, int]:  # fmt: skip
    """(working bytes, bytes received) of one Muon step on the busiest rank of a pipeline stage laid out as
    `stage`: per group ("dense", "expert") the largest figure of any rank of its shard group (under sharding
    `scheme`: optimus.optim.memory.shard_worlds), with buckets of `bucket` elements, parameters stored in
    `dtype` and the Newton-Schulz iteration in `ns_dtype`; the step's working memory is the
    largest group's (a group's buffers are freed before the next), what is received the groups' sum.
    `tp_split`: the matrices tensor parallelism splits over the stage's tp ranks (name -> the dimension split), whose
    owners gather their peers' halves. The sum of receipts is the busiest rank's when one rank is the busiest
    of both groups, and at most one unit's share above it otherwise."""
    worlds, tp = shard_worlds(scheme, stage), stage.tp
    work = received = 0
    for kind, named in groups.items():
        if not named:
            continue
        params = [(name, torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))) for name, shape in named]
        flat = FlatParams(params, worlds[kind], 0, bucket)
        slots = muon_slots_of(flat)
        if not slots:
            continue
        group_work = group_received = 0
        for rank in every_ranks_work(flat, slots):
            split = sum(u.numel for u in rank.owned if u.slot.name in tp_split)
            batches = batch_shapes(rank.owned, lambda slot: tp_split.get(slot.name), tp)
            figures = (flat.shard_numel, rank.owned_numel, rank.received, split, tp, batches, ns_dtype.itemsize)
            group_work = max(group_work, muon_group_work_bytes(*figures))
            group_received = max(group_received, (rank.received + (tp - 1) * split) * MUON_DIRECTION_BYTES)
        work, received = max(work, group_work), received + group_received
    return work, received
