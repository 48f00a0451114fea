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


def muon_work_numel(shard: int, owned: int, received: int, split: int, tp: int) -> int:
    """Elements one Muon step holds beside the parameters and their state (optimus.optim.muon): the direction
    shard, the units the rank owns and their stacked copy for Newton-Schulz (whole matrices), the exchanges'
    send and receive buffers (`received` elements each way over both rounds), and for the `split` elements of
    owned tensor-parallel matrices this rank's halves joined, the `tp` peers' halves gathered and the whole
    matrices."""
    stacked = owned - split + tp * split
    tp_buffers = (1 + 2 * tp) * split if split else 0
    return shard + owned + 2 * received + stacked + tp_buffers


def muon_step_bytes(
    numel: int, shard_world: int, param_size: int, largest_unit: int, bucket: int, tp_split: bool = False,
    tp: int = 1,
) -> tuple[int, int]:  # fmt: skip
    """(working bytes, bytes received) of one Muon step on a rank, at most, from the sizes alone: a group of
    `numel` local elements split over `shard_world` owners in buckets of `bucket` elements, whose largest unit
    of work (a matrix, or one expert's matrices) has `largest_unit` elements (optimus.optim.muon_exchange; a
    run reports its own layout's figures). Per bucket, a rank's slice takes part in at most two units it does
    not hold whole (one straddling each end, or two larger than the slice), so with several owners it sends at
    most its shard or two units per bucket, and receives as much back plus at most two units per bucket of
    the units it owns. `tp_split`: the group's matrices are split by tensor parallelism over `tp` ranks, and
    the owner gathers the other halves."""
    shard = padded_numel(numel, shard_world, param_size) // shard_world
    n_buckets = len(bucket_sizes(numel, shard_world, param_size, bucket)) if numel else 0
    if shard_world == 1:
        owned, received = shard, 0  # every unit, assembled from the shard alone
    else:
        sent = min(shard, 2 * n_buckets * largest_unit)
        remote_of_owned = min(numel, 2 * n_buckets * largest_unit)
        owned, received = min(numel, shard + remote_of_owned), sent + remote_of_owned
    split = owned if tp_split and tp > 1 else 0
    work = muon_work_numel(shard, owned, received, split, tp)
    return work * MUON_DIRECTION_BYTES, (received + (tp - 1) * split) * MUON_DIRECTION_BYTES


def rank_update_bytes(
    rule: str, scheme: str, dense: int, expert_local: int, stage: Layout, param_size: int,
    largest_units: dict[str, int] | None = None, bucket: int = 2**62,
) -> dict[str, int]:  # fmt: skip
    """What the update rule `rule` adds to one optimizer step of a rank (the arguments of rank_state_bytes):
    `step_work_bytes` alive during the step only, `gather_received_bytes` received by the rule's own collectives,
    beside `param_gather_received_bytes`, the parameters' all-gather that every rule has. `largest_units`:
    Muon's largest unit of work per group, whole (optimus.optim.muon.largest_units); `bucket`: elements per
    bucket (bucket_numel)."""
    worlds, tp = shard_worlds(scheme, stage), stage.tp
    out = {"step_work_bytes": 0, "gather_received_bytes": 0, "param_gather_received_bytes": 0}
    for numel, kind in ((dense, "dense"), (expert_local, "expert")):
        n = padded_numel(numel, worlds[kind], param_size)
        out["param_gather_received_bytes"] += (n - n // worlds[kind]) * param_size
        if rule == "muon":
            largest = (largest_units or {}).get(kind, 0)
            split = kind == "dense" and tp > 1
            work, received = muon_step_bytes(numel, worlds[kind], param_size, largest, bucket, split, tp)
            out["step_work_bytes"] += work
            out["gather_received_bytes"] += received
    return out


def zero_bucket_bytes(bucket_mb: float, zero: int) -> int:
    """Bytes of parameters per bucket: `optim.bucket_mb` under ZeRO-2; ZeRO-1 reduces in step(), where only
    the collective size limit cuts a group."""
    return int(bucket_mb * 2**20) if zero == 2 else 2**62


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
