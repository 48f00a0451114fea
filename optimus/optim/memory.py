"""The sharded optimizer's memory arithmetic: what one rank holds per parameter group, by scheme and ZeRO stage.

The one source of these figures: the sharder allocates what they count, `memory_bytes()` reports them in
run_info.json, and `optimus plan` predicts them before a run (optimus/plan.py). Which ranks split each
group's state (its owner ranks) follows the scheme; a pipeline stage's ranks are its world:

    scheme     dense owners                                          expert owners
    none       1                                                     1
    standard   stage / ep (the expert-data-parallel ranks; tp > 1:   stage / ep
               the dense data-parallel ranks, stage / tp)
    ep_aware   stage / tp (every rank of the stage when tp = 1)      stage / ep

With optim.shard_ranks = S (hierarchical sharding) both sharded schemes' owners are S for each group: the state is
split over S ranks, and the group's other owners above hold copies of the same shards (shard_worlds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from optimus.config import SHARDING_SCHEMES
from optimus.layout import Layout
from optimus.parallel.flat_buffer import bucket_sizes, padded_numel

MASTER_BYTES = 4  # per owned element: the fp32 master copy, when the parameters are 16-bit
# Reductions of one group launched and not yet finished. Two keep the network busy while the backward packs the
# next bucket; more would only hold more staged gradients.
BUCKETS_IN_FLIGHT = 2


def grads_by_hook(grad_dtype, param_dtype, tensor_parallel: bool) -> bool:
    """Whether a parameter group's gradients reach the optimizer's buffers by hook rather than in .grad.
    Autograd accumulates .grad in the parameter dtype, into a view of the gradient buffer; when the buffer holds
    another dtype (optim.grad_dtype), or the gradients are DTensors (a tensor-parallel dense group), hooks move
    every micro-batch's gradient into the buffers instead. The sharder (ShardGroup) and the planner both ask this."""
    return grad_dtype != param_dtype or tensor_parallel


def shard_worlds(scheme: str, stage: Layout) -> dict[str, int]:
    """How many ranks split each group's optimizer state in a pipeline stage of layout `stage` (its one_stage()).
    With tp > 1 a dense element has dp replicas (the data-parallel ranks), which both sharding schemes split
    it over. With optim.shard_ranks = S (stage.shard_ranks) each group's state is split over S of them and
    replicated over the rest (hierarchical sharding)."""
    if scheme not in SHARDING_SCHEMES:
        raise ValueError(f"unknown sharding scheme {scheme!r}; expected one of {SHARDING_SCHEMES}")
    if scheme == "none":
        return {"dense": 1, "expert": 1}
    dense = {"standard": stage.edp if stage.tp == 1 else stage.dp, "ep_aware": stage.dp}[scheme]
    return {"dense": stage.shard_size(dense), "expert": stage.shard_size(stage.edp)}  # optim.shard_ranks, or all


@dataclass
class StateBytes:
    """Persistent bytes of one rank's optimizer-managed tensors; padding is the part held for alignment."""

    param_bytes: float = 0
    grad_bytes: float = 0
    master_bytes: float = 0
    optim_state_bytes: float = 0  # the update rule's state (AdamW: two moments)
    padding_bytes: float = 0

    @property
    def total(self) -> float:
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optim_state_bytes

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def rounded(self) -> dict[str, int]:
        return {f.name: math.ceil(getattr(self, f.name)) for f in fields(self)}


def group_state_bytes(
    numel: int,
    shard_world: int,
    param_size: int,
    grad_size: int,
    zero: int,
    state_bytes_per_element: int,
    padded: bool = True,
) -> StateBytes:
    """Bytes one parameter group of `numel` local elements holds on a rank (the layout the sharder allocates),
    with `state_bytes_per_element` of the update rule's state per owned element (AdamW: 8)."""
    n = padded_numel(numel, shard_world, param_size) if padded else numel
    shard = n / shard_world
    full_grad = n * grad_size if zero == 1 else 0
    grad_shard = 0 if (zero == 1 and shard_world == 1) else shard * grad_size  # ZeRO-1, one owner: the same buffer
    master = shard * MASTER_BYTES if param_size != 4 else 0
    out = StateBytes(n * param_size, full_grad + grad_shard, master, shard * state_bytes_per_element)
    if padded:
        unpadded = group_state_bytes(numel, shard_world, param_size, grad_size, zero, state_bytes_per_element, False)
        out.padding_bytes = out.total - unpadded.total
    return out


def rank_state_bytes(
    scheme: str, dense: int, expert_local: int, stage: Layout, param_size: int, grad_size: int, zero: int,
    *, state_bytes_per_element: int,
) -> StateBytes:  # fmt: skip
    """Bytes of a rank of a pipeline stage laid out as `stage` with `dense` and `expert_local` parameter elements
    (`dense`: what this tp rank holds), with an update rule keeping `state_bytes_per_element` per owned element:
    what `optimus plan` and run_info report."""
    worlds = shard_worlds(scheme, stage)
    total = StateBytes()
    for numel, shard_world in ((dense, worlds["dense"]), (expert_local, worlds["expert"])):
        total = total + group_state_bytes(numel, shard_world, param_size, grad_size, zero, state_bytes_per_element)
    return total


MUON_DIRECTION_BYTES = 4  # per element: the fp32 update direction that Muon moves whole (optimus.optim.muon)


def newton_schulz_batch_bytes(shape: tuple[int, int], count: int, ns_bytes: int) -> int:
    """Bytes one batch of `count` [rows, cols] matrices takes in Muon's orthogonalisation (optimus.optim.muon
    newton_schulz, one call per shape): their fp32 stack, and the larger of the iteration's working set (with m x n
    the matrix laid wide, m <= n, in its dtype of `ns_bytes` per element: two iterates [count, m, n] and two Gram
    products [count, m, m]) and its result beside one matrix's fp32 copy."""
    m, n = sorted(shape)
    stack = count * m * n * MUON_DIRECTION_BYTES
    iteration = 2 * ns_bytes * count * (m * n + m * m)
    result = ns_bytes * count * m * n + MUON_DIRECTION_BYTES * m * n
    return stack + max(iteration, result)


def muon_group_work_bytes(
    shard: int, owned: int, exchanged: int, split: int, tp: int, batches: dict[tuple[int, int], int], ns_bytes: int
) -> int:
    """Bytes one group's part of a Muon step holds on a rank at its peak (optimus.optim.muon: a group's buffers
    are freed before the next group's step, a batch's before the next batch): the fp32 directions of the rank's
    `shard` elements and of the `owned` elements of the units it owns whole, and the larger of one exchange (the
    `exchanged` elements it sends and receives) and the orthogonalisation: with tensor parallelism, for the
    `split` elements of owned matrices that `tp` ranks split, this rank's halves joined, the peers' halves and
    the whole matrices, beside the largest of the `batches` (shape -> matrices, newton_schulz_batch_bytes)."""
    d = MUON_DIRECTION_BYTES
    tp_buffers = (1 + 2 * tp) * split * d if split else 0
    batch = max((newton_schulz_batch_bytes(shape, n, ns_bytes) for shape, n in batches.items()), default=0)
    return (shard + owned) * d + max(exchanged * d, tp_buffers + batch)


def rank_update_bytes(
    scheme: str, dense: int, expert_local: int, stage: Layout, param_size: int, rule_step: tuple[int, int] = (0, 0)
) -> dict[str, int]:
    """What the update rule adds to one optimizer step of a rank (the arguments of rank_state_bytes):
    `step_work_bytes` alive during the step only and `gather_received_bytes` received by the rule's own
    collectives, which `rule_step` gives ((0, 0) for AdamW; Muon's: optimus.optim.muon_plan), beside
    `param_gather_received_bytes`, the parameters' all-gather that every rule has."""
    worlds = shard_worlds(scheme, stage)
    gathered = 0
    for numel, kind in ((dense, "dense"), (expert_local, "expert")):
        n = padded_numel(numel, worlds[kind], param_size)
        gathered += (n - n // worlds[kind]) * param_size
    work, received = rule_step
    return {"step_work_bytes": work, "gather_received_bytes": received, "param_gather_received_bytes": gathered}


def zero_bucket_bytes(bucket_mb: float, zero: int, overlap_param_gather: bool = False) -> int:
    """Bytes of parameters per bucket: `optim.bucket_mb` under ZeRO-2 (the backward reduces bucket by bucket) and
    with `overlap_param_gather` (each block of the next forward waits for its own buckets: in one bucket, the first
    block would wait for every parameter of the group); otherwise ZeRO-1 reduces and gathers in step(), where only
    the collective size limit cuts a group."""
    return int(bucket_mb * 2**20) if zero == 2 or overlap_param_gather else 2**62


def bucket_numel(bucket_bytes: int, max_numel: int, param_size: int) -> int:
    """Elements per gradient bucket (`optim.bucket_mb` under ZeRO-2, capped by `optim.max_collective_numel`)."""
    return min(max_numel, bucket_bytes // param_size)


def zero2_staging_bytes(numel: int, shard_world: int, param_size: int, grad_size: int, bucket: int) -> tuple[int, int]:
    """ZeRO-2: the most bytes of one group's staged gradient buckets alive at once (during the last backward,
    at its end). During it: two buckets being packed (a bucket is reduced as soon as it is complete, but a
    parameter's gradient can arrive before that of a smaller one laid out before it, in the previous bucket)
    and BUCKETS_IN_FLIGHT launched ones. At its end, until step() waits: the last BUCKETS_IN_FLIGHT launched.
    A launched bucket holds the receive buffer of its size that gloo's reduce-scatter needs
    (optimus.parallel.collectives; counted on every backend)."""
    sizes = bucket_sizes(numel, shard_world, param_size, bucket)
    bucket_bytes = max(sizes, default=0) * grad_size
    packing = min(len(sizes), 2)
    launched = min(len(sizes) - 1, BUCKETS_IN_FLIGHT)  # every bucket but the last is launched while one is packed
    return (packing + 2 * launched) * bucket_bytes, 2 * min(len(sizes), BUCKETS_IN_FLIGHT) * bucket_bytes


def rank_zero2_staging_bytes(
    scheme: str, dense: int, expert_local: int, stage: Layout, param_size: int, grad_size: int, bucket: int,
) -> tuple[int, int]:  # fmt: skip
    """zero2_staging_bytes of a rank's two groups (the arguments of rank_state_bytes), summed: both are alive
    in the backward (the dense group's from the head's gradient on, the experts' from the last MoE layer's)
    and at its end."""
    worlds = shard_worlds(scheme, stage)
    per_group = [
        zero2_staging_bytes(numel, worlds[kind], param_size, grad_size, bucket)
        for numel, kind in ((dense, "dense"), (expert_local, "expert"))
    ]
    return sum(during for during, _ in per_group), sum(end for _, end in per_group)
