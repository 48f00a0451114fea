"""The gradient sharder: a rank's gradients reduced over flat buffers (ZeRO-1 or ZeRO-2), aware of expert parallelism.

Two parameter groups, "dense" and "expert" (routed experts), each in flat buffers (optimus.parallel.flat_buffer),
one scheme for both:

    scheme     dense grads                                    dense owners   expert grads / owners
    none       all-reduce over the world                      all of them    all-reduce over EDP, all of them
    standard   all-reduce over EP, reduce-scatter over DP     1/DP each      reduce-scatter over EDP, 1/DP each
    ep_aware   reduce-scatter over the world (DP x EP)        1/world each   reduce-scatter over EDP, 1/DP each

(a pipeline stage's ranks are the world here; with tensor parallelism the dense group's replicas are the stage's
ranks with the same tp rank). With optim.shard_ranks = S (hierarchical sharding) a sharded scheme's reduce-scatter
and all-gather run inside this rank's shard group (S consecutive ranks of the group's ranks above), which owns the
whole state, 1/S each, and the reduce-scatter's result is then all-reduced over the replica group (the ranks at the
same place in the other shard groups), in the same dtype:

    scheme     dense grads                                        expert grads                  owners
    standard   all-reduce over EP, reduce-scatter over S of EDP,  reduce-scatter over S of EDP, 1/S each
               all-reduce over EDP / S                             all-reduce over EDP / S
    ep_aware   reduce-scatter over S of DP, all-reduce over DP/S  (as standard)                 1/S each

(S = 1: no reduce-scatter, one all-reduce over the replicas). Reductions SUM; `mean_scale` turns the sums into the
mean over the global batch (an expert's local gradient already holds every EP peer's tokens through the dispatcher's
backward).

What the sharder owns: each group's flat parameter buffer (adopted from the layout `parallelize` allocated, or a
copy), its gradient buffers, the fp32 master copy of the slices this rank owns (when the parameters are 16-bit),
the hooks that collect the gradients, the bucketed reductions, the global gradient norm and the all-gathers of
the updated slices, before `gather()` returns or, with `overlap_param_gather`, behind the next forward
(optimus.optim.gather_overlap). What it does not own: the update rule, which `owned_slices()` hands the owned
fp32 slices and their gradients (optimus.optim.adamw), and which moves anything beyond them through the group's
own collectives (`exchange_shard`, `all_gather_tp`: Muon's whole matrices, optimus.optim.muon_exchange).

How one group's gradients arrive and are reduced, under ZeRO-1 and ZeRO-2, is in optimus.optim.shard_group (the
ShardGroup); the sharder chooses the groups' ranks, hooks the parameters to them and runs a step over them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import nullcontext

import torch

from optimus.kernels import grad_sink
from optimus.model.moe.experts import expert_offsets
from optimus.optim.gather_overlap import attach_gather_waits, buckets_needed, buckets_of_params
from optimus.optim.grad_norm import global_grad_norm, owned_sq_norm
from optimus.optim.memory import StateBytes, bucket_numel, shard_worlds
from optimus.optim.shard_group import GroupComm, OwnedSlice, ShardGroup, TensorParallelGrads
from optimus.parallel import ParallelState
from optimus.parallel.flat_buffer import GlobalPlace, param_groups
from optimus.parallel.tensor_parallel import local_grad, tp_global_offsets, tp_grad_roles


def group_comms(ps: ParallelState, scheme: str) -> dict[str, GroupComm]:
    worlds = shard_worlds(scheme, ps.layout)
    if scheme == "none":
        expert = GroupComm(None, 1, 0, ps.edp_group, ps.edp, ps.edp_rank == 0)
    else:
        expert = split_over(ps, "edp")
    if ps.tp > 1:  # a dense slice's replicas: the data-parallel ranks with this tp rank (optimus.parallel.state)
        if scheme == "none":
            dense = GroupComm(None, 1, 0, ps.dense_dp_group, ps.dp, ps.dp_rank == 0)
        else:
            dense = split_over(ps, "dp")
    elif scheme == "none":
        dense = GroupComm(None, 1, 0, ps.world_group, ps.world_size, ps.rank == 0)
    elif scheme == "standard":
        dense = split_over(ps, "edp", ps.ep_group, ps.ep, ps.ep_rank == 0)
    else:
        dense = split_over(ps, "dp")  # with tp = 1 the data-parallel ranks are the whole stage
    assert (dense.shard_world, expert.shard_world) == (worlds["dense"], worlds["expert"])
    return {"dense": dense, "expert": expert}


def split_over(ps: ParallelState, ranks: str, pre_group=None, pre_world: int = 1, counts: bool = True) -> GroupComm:
    """A group's state split over the data-parallel (`ranks` = "dp"; the stage's ranks with tp = 1) or the
    expert-data-parallel ("edp") ranks: over all of them, or with optim.shard_ranks over this rank's shard group
    only, the replica group then summing each shard's reduced gradient (hierarchical sharding, optimus.layout)."""
    world, position = (ps.dp, ps.dp_rank) if ranks == "dp" else (ps.edp, ps.edp_rank)
    if ps.layout.shard_ranks is None:
        whole = ps.edp_group if ranks == "edp" else ps.dense_dp_group if ps.tp > 1 else ps.world_group
        return GroupComm(whole, world, position, pre_group, pre_world, counts)
    layout, (replica, shard_rank) = ps.layout, ps.layout.shard_place(position, world)
    shard_group, replica_group = getattr(ps, f"{ranks}_shard_group"), getattr(ps, f"{ranks}_replica_group")
    # Every replica group holds the same reduced shard: its first shard group's ranks count it in the norm.
    counts = counts and replica == 0
    return GroupComm(
        shard_group, layout.shard_size(world), shard_rank, pre_group, pre_world, counts, replica_group,
        layout.shard_replicas(world),
    )  # fmt: skip


def expert_global_offsets(model: torch.nn.Module, names: list[str], ep: int) -> dict[str, GlobalPlace]:
    """Expert params: (first element in the tensor of all E experts, full shape)."""
    first_expert = expert_offsets(model)
    out = {}
    for name in names:
        param = model.get_parameter(name)
        per_expert = param[0].numel() if param.dim() else 1
        out[name] = (first_expert[name] * per_expert, (param.shape[0] * ep, *param.shape[1:]), None)
    return out


class GradSharder:
    """The gradients of one rank's model (or of its pipeline stages, merged), reduced and sharded by `scheme`
    (see the module docstring); the fp32 slices this rank owns, for an update rule; the updated parameters
    all-gathered back.

    Per step: backwards (hooks collect the gradients), then `reduce()` -> the global norm of the mean gradient,
    an update of `owned_slices()`, `gather()`, `zero_grad()`. `tied` (optimus.parallel.pipeline.TiedEmbedding):
    tie_embeddings across pipeline stages, whose head gradient joins the embedding's before its reduction and
    whose head takes the embedding's updated values after `gather()`. `grad_sinks`: see ShardGroup.
    """

    def __init__(
        self, model: torch.nn.Module, ps: ParallelState, scheme: str, zero: int, grad_dtype: torch.dtype,
        bucket_bytes: int, max_numel: int, micro_batches: int = 1, timers=None, tied=None, grad_sinks: bool = True,
    ):  # fmt: skip
        self.ps, self.scheme, self.zero, self.tied = ps, scheme, zero, tied
        self.mean_scale = 1.0 / ps.dp  # the reductions sum over the replicas of the global batch
        self.timers = timers
        self.overlapping = False  # gather() leaves its all-gathers to the next forward (overlap_param_gather)
        self._gather_hooks: list = []  # the forward pre-hooks that wait for them
        comms = group_comms(ps, scheme)
        tp = TensorParallelGrads(ps.tp_group, ps.tp_rank, tp_grad_roles(model)) if ps.tp > 1 else None
        self.groups: dict[str, ShardGroup] = {}
        for kind, params in param_groups(model).items():
            if not params:
                continue
            names = [n for n, _ in params]
            if kind == "expert":
                offsets = expert_global_offsets(model, names, ps.ep)
            else:
                offsets = tp_global_offsets(model, names) if tp else None
            bucket = bucket_numel(bucket_bytes, max_numel, params[0][1].element_size())
            group_tp = tp if kind == "dense" else None
            self.groups[kind] = ShardGroup(
                params, comms[kind], bucket, zero, grad_dtype, offsets, micro_batches, group_tp, grad_sinks
            )
        self._tied_slot = self._find_tied_slot()
        self._register_hooks()

    def _find_tied_slot(self) -> tuple[str, int] | None:
        """(group, slot) of the embedding whose head lives on another stage; its ZeRO-2 reduction waits for it."""
        if self.tied is None or self.tied.embedding is None:
            return None
        for kind, group in self.groups.items():
            for i, s in enumerate(group.flat.slots):
                if s.param is self.tied.embedding:
                    group.deferred.add(i)
                    return kind, i
        raise RuntimeError("the tied embedding is not among the trained parameters of this rank")

    def _register_hooks(self) -> None:
        for group in self.groups.values():
            for i, s in enumerate(group.flat.slots):
                if group.zero == 2:
                    s.param.register_hook(_arrival(group, i))
                    s.param.register_post_accumulate_grad_hook(_storing(group, i))
                elif group.grads_by_hook:
                    s.param.register_post_accumulate_grad_hook(_accumulation(group, i))

    def _timed(self, name: str):
        return self.timers(name) if self.timers else nullcontext()

    # ---- one step -------------------------------------------------------------

    def finish_reduction(self) -> None:
        """Finish every group's reductions of this step's gradients (the grad shards then hold sums over the
        replicas); with a tie across stages, the head's gradient joins the embedding's first."""
        for group in self.groups.values():
            group.collect()
        extra = self.tied.exchange_gradient() if self.tied is not None else None
        if extra is not None:
            kind, slot = self._tied_slot
            self.groups[kind].add_to_gradient(slot, extra)
        for group in self.groups.values():
            group.reduce_rest()

    def reduce(self) -> float:
        """Finish the step's reductions; the global 2-norm of the mean gradient over every stage (nan or inf when
        some gradient is not finite)."""
        self._finish()
        sq_sums = [g.sq_norm() for g in self.groups.values()]
        norm_of_sums = global_grad_norm(sq_sums, self.ps.world_group, self.ps.is_distributed, self.ps.pp_group)
        return norm_of_sums * self.mean_scale

    def reduce_local(self) -> torch.Tensor:
        """Finish the step's reductions; this rank's share of the squared norm of the summed gradient (fp64, 0-d,
        on the device), which summed over every rank and scaled by mean_scale**2 is the square of reduce()'s."""
        self._finish()
        return owned_sq_norm([g.sq_norm() for g in self.groups.values()])

    def _finish(self) -> None:
        self.wait_for_params()  # the previous step's, where no forward has waited for them
        with self._timed("grad_reduce"):  # ZeRO-2: only the part not hidden behind the backward
            self.finish_reduction()

    def owned_slices(self) -> Iterator[OwnedSlice]:
        """The fp32 slices this rank owns, group by group and bucket by bucket, with their reduced gradients."""
        for kind, group in self.groups.items():
            yield from group.owned_slices(kind)

    def gather(self) -> None:
        """All-gather the updated slices into the parameters: before returning, or with overlap_param_gather
        behind the next forward. A tied head then takes the embedding's new values."""
        with self._timed("param_gather"):
            for group in self.groups.values():
                group.gather_params()
            if not self.overlapping:  # else each block's forward waits for its own buckets
                for group in self.groups.values():
                    group.wait_gathered()
        if self.tied is not None:
            if self.tied.embedding is not None:  # the embedding is read here, outside a forward
                self.wait_for_params(buckets_needed([self.tied.embedding], buckets_of_params(self)))
            self.tied.exchange_weight()

    def zero_grad(self) -> None:
        for group in self.groups.values():
            group.zero_grad()

    def discard_gradients(self) -> None:
        """Drop this step's gradients on every rank alike (all ranks call it for the same step): the reductions
        ZeRO-2 started in the backward are finished first, so none is left in flight to race the next step's."""
        self.finish_reduction()
        self.zero_grad()

    # ---- the parameters' all-gathers ------------------------------------------

    def overlap_param_gather(self, roots: list[torch.nn.Module]) -> None:
        """Let gather() return with its all-gathers in flight: each block of `roots` (the modules the caller
        runs forward) waits for its own buckets when its forward starts (optimus.optim.gather_overlap)."""
        for handle in self._gather_hooks:  # called again (other roots): the new hooks replace the old
            handle.remove()
        self._gather_hooks = attach_gather_waits(self, roots)
        self.overlapping = True

    def wait_for_params(self, buckets: dict[str, Iterable[int]] | None = None) -> None:
        """Finish the parameter all-gathers still in flight: of `buckets` ({group: bucket indices}), else all.
        Whatever reads parameters outside a forward after a step (a checkpoint, a tied-weight copy) calls it."""
        pending = [(kind, g) for kind, g in self.groups.items() if g.gathers and (buckets is None or kind in buckets)]
        if not pending:
            return
        with self._timed("param_gather"):
            for kind, group in pending:
                group.wait_gathered(None if buckets is None else buckets[kind])

    # ---- what it holds --------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """The persistent tensors the sharder allocated: gradient buffers and fp32 master."""
        held = []
        for g in self.groups.values():
            held += [t for t in (g.full_grad, g.grad_shard, g.master) if t is not None]
        return held

    def state_bytes(self, state_bytes_per_element: int) -> StateBytes:
        """Persistent bytes on this rank, with an update rule keeping `state_bytes_per_element` per owned one."""
        total = StateBytes()
        for g in self.groups.values():
            total = total + g.state_bytes(state_bytes_per_element)
        return total


def _arrival(group: ShardGroup, slot_idx: int):
    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        return group.arrive(slot_idx, grad)

    return hook


def _storing(group: ShardGroup, slot_idx: int):
    def hook(param: torch.Tensor) -> None:
        group.stored(slot_idx)

    return hook


def _accumulation(group: ShardGroup, slot_idx: int):
    """ZeRO-1 with grads_by_hook: every micro-batch's gradient is added into the full buffer as autograd stores it."""

    def hook(param: torch.Tensor) -> None:
        if not grad_sink.take_added(param):  # else its kernel added it into the buffer already
            group.accumulate(slot_idx, local_grad(param))
        param.grad = None

    return hook
