"""AdamW over flat parameter buffers, replicated or sharded (ZeRO-1 / ZeRO-2), aware of expert parallelism.

Two parameter groups, each in flat buffers (optimus.optim.flat_buffer), one scheme for all of them:

    scheme     dense grads                                    dense state   expert grads / state
    none       all-reduce over the world                      whole         all-reduce over EDP, whole
    standard   all-reduce over EP, reduce-scatter over DP     1/DP          reduce-scatter over EDP, 1/DP
    ep_aware   reduce-scatter over the world (DP x EP)        1/world       reduce-scatter over EDP, 1/DP

Reductions SUM and the update divides by the world size, so it is the one for the
mean loss over the global batch (an expert's local grad already holds every EP
peer's tokens through the dispatcher's backward). After the update each rank's
owned slices are all-gathered back into the parameters over the group that
sharded them: before step() returns, or, with `overlap_param_gather`, behind the
next forward (optimus.optim.gather_overlap).

Precision: parameters live in their own dtype (bf16 for `train.dtype=bf16`);
gradients are accumulated over micro-batches and reduced in `optim.grad_dtype`;
the owned shard keeps an fp32 master copy when the parameters are not fp32, and
the two Adam moments are always fp32.

ZeRO-1 keeps a full gradient buffer (with grad_dtype = parameter dtype, the
parameters' .grad are views into it; otherwise hooks add every micro-batch's grad
into it) and reduces in step(). ZeRO-2 reduces each bucket from
post-accumulate-grad hooks during the backward of the last micro-batch (async)
and keeps only the owned gradient shard between steps. A group has at most
BUCKETS_IN_FLIGHT reductions in flight: launching one more first finishes the
oldest and frees its staging copy, so the staged gradients never grow to the
whole gradient that ZeRO-2 exists not to hold (zero2_staging_bytes counts them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from optimus.config import SHARDING_SCHEMES, TORCH_DTYPES, OptimConfig
from optimus.model.counts import expert_offsets
from optimus.optim.adamw import AdamWHyper, adamw_update
from optimus.optim.flat_buffer import FlatParams, GlobalPlace, bucket_sizes, padded_numel
from optimus.optim.gather_overlap import attach_gather_waits
from optimus.optim.grad_norm import clip_coefficient, global_grad_norm, sum_of_squares
from optimus.optim.state_ranges import StateRange, copy_overlap, range_key
from optimus.parallel import ParallelState
from optimus.parallel.collectives import reduce_scatter_sum
from optimus.parallel.tensor_parallel import PARTIAL, SPLIT, local_grad, tp_global_offsets, tp_grad_roles

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

SCHEMES = SHARDING_SCHEMES  # the values of optim.sharding that name a scheme (all but auto)
MASTER_BYTES, MOMENT_BYTES = 4, 8  # per owned element: fp32 master copy; two fp32 Adam moments
# Reductions of one group launched and not yet finished. Two keep the network busy while the backward packs the
# next bucket; more would only hold more staged gradients.
BUCKETS_IN_FLIGHT = 2


def shard_worlds(scheme: str, world: int, dp: int, tp: int = 1) -> dict[str, int]:
    """How many ranks split each group's optimizer state (see the table above). With tp > 1 a dense element
    has world / tp replicas (the dense data-parallel ranks), which both sharding schemes split it over."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown sharding scheme {scheme!r}; expected one of {SCHEMES}")
    dense = {"none": 1, "standard": dp if tp == 1 else world // tp, "ep_aware": world // tp}[scheme]
    return {"dense": dense, "expert": 1 if scheme == "none" else dp}


@dataclass
class StateBytes:
    """Persistent bytes of one rank's optimizer-managed tensors; padding is the part held for alignment."""

    param_bytes: float = 0
    grad_bytes: float = 0
    master_bytes: float = 0
    optim_state_bytes: float = 0  # the two Adam moments
    padding_bytes: float = 0

    @property
    def total(self) -> float:
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optim_state_bytes

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def rounded(self) -> dict[str, int]:
        return {f.name: math.ceil(getattr(self, f.name)) for f in fields(self)}


def group_state_bytes(
    numel: int, shard_world: int, param_size: int, grad_size: int, zero: int, padded: bool = True
) -> StateBytes:
    """Bytes one parameter group of `numel` local elements holds on a rank (the layout ShardGroup allocates)."""
    n = padded_numel(numel, shard_world, param_size) if padded else numel
    shard = n / shard_world
    full_grad = n * grad_size if zero == 1 else 0
    grad_shard = 0 if (zero == 1 and shard_world == 1) else shard * grad_size  # ZeRO-1, one owner: the same buffer
    master = shard * MASTER_BYTES if param_size != 4 else 0
    out = StateBytes(n * param_size, full_grad + grad_shard, master, shard * MOMENT_BYTES)
    if padded:
        out.padding_bytes = out.total - group_state_bytes(numel, shard_world, param_size, grad_size, zero, False).total
    return out


def zero_bucket_bytes(cfg: OptimConfig) -> int:
    """Bytes of parameters per bucket: `optim.bucket_mb` under ZeRO-2; ZeRO-1 reduces in step(), where only
    the collective size limit cuts a group."""
    return int(cfg.bucket_mb * 2**20) if cfg.zero == 2 else 2**62


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
    scheme: str, dense: int, expert_local: int, world: int, dp: int, param_size: int, grad_size: int,
    bucket: int, tp: int = 1,
) -> tuple[int, int]:  # fmt: skip
    """zero2_staging_bytes of a rank's two groups (the arguments of rank_state_bytes), summed: both are alive
    in the backward (the dense group's from the head's gradient on, the experts' from the last MoE layer's)
    and at its end."""
    worlds = shard_worlds(scheme, world, dp, tp)
    per_group = [
        zero2_staging_bytes(numel, worlds[kind], param_size, grad_size, bucket)
        for numel, kind in ((dense, "dense"), (expert_local, "expert"))
    ]
    return sum(during for during, _ in per_group), sum(end for _, end in per_group)


def rank_state_bytes(
    scheme: str,
    dense: int,
    expert_local: int,
    world: int,
    dp: int,
    param_size: int,
    grad_size: int,
    zero: int,
    tp: int = 1,
) -> StateBytes:
    """Bytes of a rank with `dense` and `expert_local` parameter elements (`dense`: what this tp rank holds):
    what `optimus plan` and run_info report."""
    worlds = shard_worlds(scheme, world, dp, tp)
    total = StateBytes()
    for numel, shard_world in ((dense, worlds["dense"]), (expert_local, worlds["expert"])):
        total = total + group_state_bytes(numel, shard_world, param_size, grad_size, zero)
    return total


@dataclass
class GroupComm:
    """Which ranks reduce and own one parameter group's gradients."""

    shard_group: Any
    shard_world: int
    shard_rank: int
    pre_group: Any = None  # all-reduced over before the reduce-scatter (replicated grads: none, standard's dense)
    pre_world: int = 1
    counts_in_norm: bool = True  # False where a peer owns the same elements (count each element once)


def group_comms(ps: ParallelState, scheme: str) -> dict[str, GroupComm]:
    worlds = shard_worlds(scheme, ps.world_size, ps.dp, ps.tp)
    if scheme == "none":
        expert = GroupComm(None, 1, 0, ps.edp_group, ps.dp, ps.dp_rank == 0)
    else:
        expert = GroupComm(ps.edp_group, ps.dp, ps.dp_rank)
    if ps.tp > 1:  # a dense slice's replicas: the data-parallel ranks with this tp rank (optimus.parallel.state)
        if scheme == "none":
            dense = GroupComm(None, 1, 0, ps.dense_dp_group, ps.data_parallel, ps.data_rank == 0)
        else:
            dense = GroupComm(ps.dense_dp_group, ps.data_parallel, ps.data_rank)
    elif scheme == "none":
        dense = GroupComm(None, 1, 0, ps.world_group, ps.world_size, ps.rank == 0)
    elif scheme == "standard":
        dense = GroupComm(ps.edp_group, ps.dp, ps.dp_rank, ps.ep_group, ps.ep, ps.ep_rank == 0)
    else:
        dense = GroupComm(ps.world_group, ps.world_size, ps.rank)
    assert (dense.shard_world, expert.shard_world) == (worlds["dense"], worlds["expert"])
    return {"dense": dense, "expert": expert}


def expert_global_offsets(model: torch.nn.Module, names: list[str], ep: int) -> dict[str, GlobalPlace]:
    """Expert params: (first element in the tensor of all E experts, full shape)."""
    first_expert = expert_offsets(model)
    out = {}
    for name in names:
        param = model.get_parameter(name)
        per_expert = param[0].numel() if param.dim() else 1
        out[name] = (first_expert[name] * per_expert, (param.shape[0] * ep, *param.shape[1:]), None)
    return out


def param_groups(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """The trainable parameters of each optimizer group, in model order: "dense" and "expert" (routed experts)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    experts = expert_offsets(model)
    return {
        "dense": [(n, p) for n, p in named if n not in experts],
        "expert": [(n, p) for n, p in named if n in experts],
    }


@dataclass
class TensorParallelGrads:
    """tp > 1, the dense group: the TP group and each parameter's role there (optimus.parallel.tensor_parallel:
    split slices are complete, partial gradients are summed over the TP group, replicated ones are counted
    once in the norm)."""

    group: Any
    rank: int
    roles: dict[str, str]


class ShardGroup:
    """One parameter group: flat params, gradient buffers, fp32 master shard and AdamW moments."""

    def __init__(
        self, named, comm: GroupComm, bucket_bytes: int, max_numel: int, zero: int, grad_dtype, offsets, tp=None
    ):
        """`tp`: a TensorParallelGrads for the dense group of a tensor-parallel model, else None."""
        self.comm, self.zero, self.tp = comm, zero, tp
        bucket = bucket_numel(bucket_bytes, max_numel, named[0][1].element_size())
        self.flat = FlatParams(named, comm.shard_world, comm.shard_rank, bucket, offsets)
        flat, dev = self.flat, self.flat.device
        self.grad_dtype = grad_dtype
        # Autograd accumulates .grad in the parameter dtype; when gradients are kept in another dtype, or
        # are DTensors (tensor parallelism), hooks move every micro-batch's gradient into our buffers instead.
        self.grads_by_hook = grad_dtype != flat.dtype or tp is not None
        self.tp_partial = [tp is not None and tp.roles.get(s.name) == PARTIAL for s in flat.slots]
        self.full_grad = None
        if zero == 1:
            self.full_grad = torch.zeros(flat.padded_numel, dtype=grad_dtype, device=dev)  # [N_pad]
        if zero == 1 and comm.shard_world == 1:
            self.grad_shard = self.full_grad  # one owner: the reduced gradient is the buffer itself
        else:
            self.grad_shard = torch.zeros(flat.shard_numel, dtype=grad_dtype, device=dev)  # reduced, owned
        self.master = None  # fp32 copy of the owned slices when params are lower precision
        if flat.dtype != torch.float32:
            self.master = torch.empty(flat.shard_numel, dtype=torch.float32, device=dev)
            self.refresh_master()
        self.exp_avg = torch.zeros(flat.shard_numel, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(flat.shard_numel, dtype=torch.float32, device=dev)
        # ZeRO-2 with grads_by_hook: slot -> sum of its grads from earlier micro-batches of the step.
        self.partial: dict[int, torch.Tensor] = {}
        if zero == 1 and not self.grads_by_hook:
            self.point_grads_at_buffer()
        self.works: list[tuple[Any, torch.Tensor, torch.Tensor | None]] = []  # in flight: (work, src, copy to)
        # Parameter all-gathers in flight, by bucket, and the order step() starts them in (see gather_overlap).
        self.gathers: dict[int, tuple[Any, torch.Tensor]] = {}
        self.gather_order = list(range(len(self.flat.buckets)))
        self.reset_buckets()

    # ---- bookkeeping --------------------------------------------------------

    def refresh_master(self) -> None:
        for b in self.flat.buckets:
            self.flat.shard_view(self.master, b).copy_(self.flat.owned_view(self.flat.buffer, b))

    def point_grads_at_buffer(self) -> None:
        for s in self.flat.slots:
            s.param.grad = self.full_grad[s.start : s.end].view_as(s.param)

    def reset_buckets(self) -> None:
        buckets, slots = self.flat.buckets, self.flat.slots
        self.bucket_slots = [[i for i, s in enumerate(slots) if s.start < b.end and s.end > b.start] for b in buckets]
        self.left = [len(ids) for ids in self.bucket_slots]  # slots still to be packed, per bucket
        self.packed = [False] * len(slots)
        self.staging: dict[int, torch.Tensor] = {}
        self.next_launch = 0

    # ---- accumulation -------------------------------------------------------

    def accumulate(self, slot_idx: int, grad: torch.Tensor) -> None:
        """ZeRO-1, grads_by_hook: add one micro-batch's grad of a parameter into the full buffer."""
        s = self.flat.slots[slot_idx]
        self.full_grad[s.start : s.end].add_(grad.reshape(-1))

    def accumulate_partial(self, slot_idx: int, grad: torch.Tensor) -> None:
        """ZeRO-2, grads_by_hook, a micro-batch before the last: keep its grad in grad_dtype until the last."""
        if slot_idx in self.partial:
            self.partial[slot_idx].add_(grad.reshape(-1))
        else:
            self.partial[slot_idx] = grad.reshape(-1).to(self.grad_dtype, copy=True)

    # ---- reduction ----------------------------------------------------------

    def pack(self, slot_idx: int, grad: torch.Tensor | None) -> None:
        """ZeRO-2: copy one parameter's final local grad into the staging copy of each bucket it overlaps."""
        s = self.flat.slots[slot_idx]
        self.packed[slot_idx] = True
        earlier = self.partial.pop(slot_idx, None)
        if self.tp_partial[slot_idx]:  # this rank's share of a sum over the tp ranks: complete it first
            grad, earlier = self.sum_over_tp(slot_idx, grad, earlier), None
        for bi, b in enumerate(self.flat.buckets):
            if s.end <= b.start or s.start >= b.end:
                continue
            if bi < self.next_launch:
                raise RuntimeError(
                    f"the gradient of {s.name} arrived after its bucket was reduced: call "
                    "optimizer.set_last_micro_batch(False) before the backward of every micro-batch but the last."
                )
            if bi not in self.staging:
                self.staging[bi] = torch.zeros(b.end - b.start, dtype=self.grad_dtype, device=self.flat.device)
            lo, hi = max(s.start, b.start), min(s.end, b.end)
            dst = self.staging[bi][lo - b.start : hi - b.start]
            if grad is not None:
                dst.copy_(grad.reshape(-1)[lo - s.start : hi - s.start])
            if earlier is not None:
                dst.add_(earlier[lo - s.start : hi - s.start])
            self.left[bi] -= 1
            if self.left[bi] == 0:  # reduce it before staging the next: a large parameter spans many buckets
                self.launch_ready()

    def sum_over_tp(self, slot_idx: int, grad: torch.Tensor | None, earlier: torch.Tensor | None) -> torch.Tensor:
        """ZeRO-2: a partial slot's gradient of the step (this micro-batch's + earlier ones'), summed over tp."""
        s = self.flat.slots[slot_idx]
        total = torch.zeros(s.end - s.start, dtype=self.grad_dtype, device=self.flat.device)  # [numel]
        for part in (grad, earlier):
            if part is not None:
                total.add_(part.reshape(-1))
        dist.all_reduce(total, group=self.tp.group)
        return total

    def reduce_partials_over_tp(self) -> None:
        """ZeRO-1: sum the partial slots' accumulated gradients over the tp ranks, in one all-reduce."""
        slots = [s for s, partial in zip(self.flat.slots, self.tp_partial) if partial]
        if not slots:
            return
        joined = torch.cat([self.full_grad[s.start : s.end] for s in slots])
        dist.all_reduce(joined, group=self.tp.group)
        for s, summed in zip(slots, joined.split([s.end - s.start for s in slots])):
            self.full_grad[s.start : s.end].copy_(summed)

    def launch_ready(self, force: bool = False) -> None:
        """Start reductions of finished buckets, strictly in bucket order so every rank issues the same sequence."""
        while self.next_launch < len(self.flat.buckets) and (force or self.left[self.next_launch] == 0):
            bi = self.next_launch
            b = self.flat.buckets[bi]
            while len(self.works) >= BUCKETS_IN_FLIGHT:  # make room first: never more than that many in flight
                self.finish_oldest()
            src = self.full_grad[b.start : b.end] if self.zero == 1 else self.staging.pop(bi)
            self.launch(src, self.flat.shard_view(self.grad_shard, b))
            self.next_launch += 1

    def finish_oldest(self) -> None:
        """Wait for the oldest reduction in flight and drop its buffers (ZeRO-2: the staged bucket)."""
        work, src, copy_to = self.works.pop(0)
        work.wait()
        if copy_to is not None:
            copy_to.copy_(src)

    def launch(self, src: torch.Tensor, out: torch.Tensor) -> None:
        c = self.comm
        if c.shard_world == 1:  # one owner: an all-reduce over the replicas, if any, into src; then src -> out
            copy_to = None if out.data_ptr() == src.data_ptr() else out
            if c.pre_world > 1:
                self.works.append((dist.all_reduce(src, group=c.pre_group, async_op=True), src, copy_to))
            elif copy_to is not None:
                copy_to.copy_(src)
            return
        if c.pre_world > 1:  # the standard scheme's all-reduce over EP, before the DP reduce-scatter
            dist.all_reduce(src, group=c.pre_group)
        self.works.append((reduce_scatter_sum(out, src, c.shard_group, async_op=True), src, None))

    def finish_reduction(self) -> None:
        if self.zero == 2:
            # Grads the hooks did not see (parameters unused in the last micro-batch).
            for i, s in enumerate(self.flat.slots):
                if not self.packed[i]:
                    self.pack(i, local_grad(s.param))
                    s.param.grad = None
        elif self.grads_by_hook:
            for i, s in enumerate(self.flat.slots):  # a .grad set by hand rather than by backward
                if s.param.grad is not None:
                    self.accumulate(i, local_grad(s.param))
                    s.param.grad = None
            if self.tp is not None:
                self.reduce_partials_over_tp()
        else:
            for s in self.flat.slots:  # someone replaced or dropped a .grad view: bring it back into the buffer
                view = self.full_grad[s.start : s.end].view_as(s.param)
                if s.param.grad is None:
                    view.zero_()
                elif s.param.grad.data_ptr() != view.data_ptr():
                    view.copy_(s.param.grad)
        self.launch_ready(force=True)
        while self.works:
            self.finish_oldest()

    def zero_grad(self) -> None:
        if self.zero == 1:
            self.full_grad.zero_()
            if not self.grads_by_hook:
                self.point_grads_at_buffer()
        if self.zero == 2 or self.grads_by_hook:
            for s in self.flat.slots:
                s.param.grad = None
        self.partial.clear()
        self.reset_buckets()

    # ---- update -------------------------------------------------------------

    def sq_norm(self) -> torch.Tensor:
        """fp64 squared norm of the owned shard of the summed gradient (zero where a peer counts it)."""
        if not self.comm.counts_in_norm:
            return torch.zeros((), dtype=torch.float64, device=self.flat.device)
        if self.tp is not None and self.tp.rank > 0:  # tp rank 0 counts what the tp ranks share
            own = [r for r in self.flat.owned_ranges if self.tp.roles.get(r.name) == SPLIT]
            return sum_of_squares([self.grad_shard[r.shard_lo : r.shard_hi] for r in own], self.flat.device)
        return sum_of_squares([self.grad_shard], self.flat.device)

    def update(self, lr: float, step: int, grad_scale: float, h: AdamWHyper) -> None:
        flat, sv = self.flat, self.flat.shard_view
        for b, segments in zip(flat.buckets, flat.segments):
            param = sv(self.master, b) if self.master is not None else flat.owned_view(flat.buffer, b)
            grad, m, v = sv(self.grad_shard, b), sv(self.exp_avg, b), sv(self.exp_avg_sq, b)
            adamw_update(segments, param, grad, m, v, lr, step, h, grad_scale)

    def gather_params(self) -> None:
        """Start all-gathering every rank's updated slices into the flat parameter buffer (hence into the
        parameters), bucket by bucket in `gather_order`; `wait_gathered` finishes them."""
        flat, c = self.flat, self.comm
        for bi in self.gather_order:
            b = flat.buckets[bi]
            if c.shard_world == 1:  # this rank owns the whole bucket: round the master copy straight into it
                if self.master is not None:
                    flat.buffer[b.start : b.end].copy_(flat.shard_view(self.master, b))
                continue
            if self.master is not None:
                mine = flat.shard_view(self.master, b).to(flat.dtype)
            else:
                mine = flat.owned_view(flat.buffer, b).clone()
            work = _all_gather(flat.buffer[b.start : b.end], mine, group=c.shard_group, async_op=True)
            self.gathers[bi] = (work, mine)  # `mine` is kept until the collective has read it

    def wait_gathered(self, buckets: Iterable[int] | None = None) -> None:
        """Finish the all-gathers of `buckets` (of every bucket when None) that are still in flight."""
        for bi in list(self.gathers) if buckets is None else buckets:
            entry = self.gathers.pop(bi, None)
            if entry is not None:
                entry[0].wait()

    def state_bytes(self) -> StateBytes:
        es, gs = self.flat.buffer.element_size(), self.grad_shard.element_size()
        return group_state_bytes(self.flat.numel, self.comm.shard_world, es, gs, self.zero)


class ShardedAdamW:
    """AdamW for `optim.sharding=none | standard | ep_aware` (see the module docstring).

    The interface the trainer uses: `set_last_micro_batch(bool)` before each backward,
    `step(lr) -> pre-clip global grad norm`, `zero_grad()`, `state_dict()` /
    `load_state_dict()`, `memory_bytes()`; with `overlap_param_gather(roots)`, also
    `wait_for_params()` before reading parameters outside a forward.
    """

    def __init__(
        self, model: torch.nn.Module, cfg: OptimConfig, ps: ParallelState, grad_clip: float, scheme: str, timers=None
    ):
        """`timers`: profile.timers' `name -> context manager` (optimus.train.timers.Timers), or None."""
        if scheme not in SCHEMES:
            raise ValueError(f"unknown sharding scheme {scheme!r}; expected one of {SCHEMES}")
        self.ps, self.scheme, self.grad_clip, self.zero = ps, scheme, grad_clip, cfg.zero
        self.hyper = AdamWHyper(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay)
        self.step_count = 0
        self.last_micro_batch = True
        self.timed = timers or (lambda name: nullcontext())
        self.overlapping = False  # step() leaves its parameter all-gathers to the next forward (overlap_param_gather)
        self._gather_hooks: list = []  # the forward pre-hooks that wait for them
        by_kind = param_groups(model)
        comms = group_comms(ps, scheme)
        bucket_bytes = zero_bucket_bytes(cfg)
        grad_dtype = TORCH_DTYPES[cfg.grad_dtype]
        self.groups: dict[str, ShardGroup] = {}
        tp = TensorParallelGrads(ps.tp_group, ps.tp_rank, tp_grad_roles(model)) if ps.tp > 1 else None
        for kind, params in by_kind.items():
            if not params:
                continue
            names = [n for n, _ in params]
            if kind == "expert":
                offsets = expert_global_offsets(model, names, ps.ep)
            else:
                offsets = tp_global_offsets(model, names) if tp else None
            self.groups[kind] = ShardGroup(
                params, comms[kind], bucket_bytes, cfg.max_collective_numel, cfg.zero, grad_dtype, offsets,
                tp if kind == "dense" else None,
            )  # fmt: skip
        self._hooks: dict[torch.Tensor, Callable[[torch.Tensor], None]] = {}  # parameter -> its gradient hook
        for group in self.groups.values():
            if group.zero == 2 or group.grads_by_hook:
                for i, s in enumerate(group.flat.slots):
                    self._hooks[s.param] = self._hook(group, i)
                    s.param.register_post_accumulate_grad_hook(self._hooks[s.param])

    def _hook(self, group: ShardGroup, slot_idx: int):
        def hook(param: torch.Tensor) -> None:
            grad = local_grad(param)  # a DTensor's: this rank's slice (or share)
            if group.zero == 1:  # grads_by_hook: every micro-batch adds into the full buffer
                group.accumulate(slot_idx, grad)
                param.grad = None
            elif not self.last_micro_batch:
                if group.grads_by_hook:
                    group.accumulate_partial(slot_idx, grad)
                    param.grad = None
                # else autograd keeps accumulating in .grad; only the last micro-batch reduces
            else:
                group.pack(slot_idx, grad)  # launches the buckets it completes
                param.grad = None  # ZeRO-2 keeps only the owned shard

        return hook

    def set_last_micro_batch(self, is_last: bool) -> None:
        """Tell ZeRO-2 whether the coming backward is the last of this optimizer step (it reduces then)."""
        self.last_micro_batch = is_last

    def grads_assigned(self, params: Iterable[torch.Tensor]) -> None:
        """Take the gradients that were assigned to `params`' .grad rather than accumulated by autograd, which
        fires no post-accumulate-grad hook: torch's zero-bubble pipeline schedules assign the weight gradients
        of their weight pass. Without this, ZeRO-2 would hold the whole gradient until step()."""
        for param in params:
            hook = self._hooks.get(param)
            if hook is not None and param.grad is not None:
                hook(param)

    def zero_grad(self) -> None:
        for group in self.groups.values():
            group.zero_grad()

    def step(self, lr: float) -> float:
        """Reduce, clip and apply the gradients; returns the pre-clip global norm (no update if it is not finite)."""
        groups, world = list(self.groups.values()), self.ps.data_parallel  # the global batch's replicas
        timed = self.timed
        self.wait_for_params()  # the previous step's, where no forward has waited for them
        with timed("grad_reduce"):  # ZeRO-2: only the part not hidden behind the backward
            for group in groups:
                group.finish_reduction()  # grad shards now hold SUMS over the ranks; the mean is sum / world
        sq_sums = [g.sq_norm() for g in groups]
        norm_of_sums = global_grad_norm(sq_sums, self.ps.world_group, self.ps.is_distributed, self.ps.pp_group)
        norm = norm_of_sums / world
        self.last_micro_batch = True
        if not math.isfinite(norm):
            return norm
        self.step_count += 1
        grad_scale = clip_coefficient(norm, self.grad_clip) / world
        for group in groups:
            group.update(lr, self.step_count, grad_scale, self.hyper)
        with timed("param_gather"):
            for group in groups:
                group.gather_params()
            if not self.overlapping:  # else each block's forward waits for its own buckets
                for group in groups:
                    group.wait_gathered()
        return norm

    def overlap_param_gather(self, roots: list[torch.nn.Module]) -> None:
        """Let step() return with its parameter all-gathers in flight: each block of `roots` (the modules the
        caller runs forward) waits for its own buckets when its forward starts (optimus.optim.gather_overlap)."""
        for handle in self._gather_hooks:  # called again (other roots): the new hooks replace the old
            handle.remove()
        self._gather_hooks = attach_gather_waits(self, roots)
        self.overlapping = True

    def wait_for_params(self, buckets: dict[str, Iterable[int]] | None = None) -> None:
        """Finish the parameter all-gathers still in flight: of `buckets` ({group: bucket indices}), else all.
        Whatever reads parameters outside a forward after step() (a checkpoint, a tied-weight copy) calls it."""
        pending = [(kind, g) for kind, g in self.groups.items() if g.gathers and (buckets is None or kind in buckets)]
        if not pending:
            return
        with self.timed("param_gather"):
            for kind, group in pending:
                group.wait_gathered(None if buckets is None else buckets[kind])

    # ---- reporting and checkpoints -------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """The persistent tensors this optimizer allocated: gradient buffers, fp32 master, moments (what
        memory_bytes counts besides the parameters)."""
        held = []
        for g in self.groups.values():
            held += [t for t in (g.full_grad, g.grad_shard, g.master, g.exp_avg, g.exp_avg_sq) if t is not None]
        return held

    def memory_bytes(self) -> dict[str, int]:
        """Persistent bytes on this rank (parameters, gradients, fp32 master, moments, and the padding in them)."""
        total = StateBytes()
        for g in self.groups.values():
            total = total + g.state_bytes()
        return total.rounded()

    def state_dict(self) -> dict:
        """Moments (and fp32 master) of every owned range, keyed "name[lo:hi]" in the full parameter's flat index
        (or "name[lo:hi]@cols[a:b]" in a block of its columns, optimus.optim.state_ranges).

        The tensors are views of the live state (a checkpoint writer copies or writes them before the next step).
        """
        shards = {}
        for g in self.groups.values():
            for r in g.flat.owned_ranges:
                entry = {
                    "name": r.name, "lo": r.global_lo, "hi": r.global_hi, "shape": list(r.global_shape), "cols": r.cols,
                    "exp_avg": g.exp_avg[r.shard_lo : r.shard_hi],
                    "exp_avg_sq": g.exp_avg_sq[r.shard_lo : r.shard_hi],
                }  # fmt: skip
                if g.master is not None:
                    entry["master"] = g.master[r.shard_lo : r.shard_hi]
                shards[range_key(r.name, r.global_lo, r.global_hi, r.cols)] = entry
        return {"step": self.step_count, "scheme": self.scheme, "shards": shards}

    def load_state_dict(self, state: dict) -> None:
        """Fill every owned range from the saved shards that overlap it (any layout, as long as they cover it)."""
        self.wait_for_params()  # the master copy is refreshed from the parameters
        by_name: dict[str, list[dict]] = {}
        for entry in state["shards"].values():
            by_name.setdefault(entry["name"], []).append(entry)
        for g in self.groups.values():
            if g.master is not None:
                g.refresh_master()  # for ranges saved without a master copy (an fp32 run)
            for r in g.flat.owned_ranges:
                mine, covered = StateRange(r.global_lo, r.global_hi, r.global_shape, r.cols), 0
                for e in by_name.get(r.name, []):
                    saved = StateRange(e["lo"], e["hi"], r.global_shape, e.get("cols"))
                    for kind in ("exp_avg", "exp_avg_sq", "master"):
                        if kind != "master" or (g.master is not None and "master" in e):
                            n = copy_overlap(getattr(g, kind)[r.shard_lo : r.shard_hi], mine, e[kind], saved)
                    covered += n
                if covered != r.global_hi - r.global_lo:
                    raise ValueError(
                        f"the optimizer state does not cover elements [{r.global_lo}, {r.global_hi}) of {r.name}: "
                        "load a checkpoint saved from a model of the same shape, with the shards of every rank."
                    )
        self.step_count = int(state["step"])
