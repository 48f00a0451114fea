"""One parameter group of the gradient sharder: its flat buffers, how its gradients arrive and are reduced, and the
all-gathers of its updated slices.

ZeRO-1 keeps a full gradient buffer (with grad_dtype = parameter dtype the parameters' .grad are views into it;
otherwise hooks add each micro-batch's gradient into it) and reduces in `reduce()`. ZeRO-2 keeps only the owned
shard between steps and reduces each bucket during the step's last backward, as soon as its gradients are
complete. It knows a gradient is complete by counting: every trained parameter receives one gradient per
micro-batch, seen by a tensor hook (which also fires in a zero-bubble pipeline schedule's weight pass, where
autograd's accumulation and its hooks are skipped), so the `micro_batches`-th arrival is the step's last; no
caller has to say which backward is the last. A parameter that missed a micro-batch is reduced in `reduce()`. A
group has at most BUCKETS_IN_FLIGHT reductions in flight: launching one more first finishes the oldest and frees
its staging copy, so the staged gradients never grow to the whole gradient that ZeRO-2 exists not to hold. Hook-fed
fp32 gradients are offered as each parameter's gradient sink (optimus.kernels.grad_sink), ZeRO-1's full buffer or
ZeRO-2's sums of a step's micro-batches: a kernel that adds a weight's gradient there itself marks the weight, and
the hook drops what autograd stored. With
hierarchical sharding (optim.shard_ranks: a GroupComm with a replica group) the reduce-scatter runs inside the shard
group and, once it has finished, the shard it produced is all-reduced over the replica group (in flight beside the
next buckets' reduce-scatters, holding no staged copy); `reduce_rest` waits for those too.

Apart from the GradSharder (optimus.optim.sharder), which chooses each group's ranks by scheme (GroupComm), hooks
its parameters' gradients to these groups and runs a step over them: everything done bucket by bucket and slot by
slot of one group is here.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from optimus.kernels import grad_sink
from optimus.optim.grad_norm import sum_of_squares
from optimus.optim.memory import BUCKETS_IN_FLIGHT, StateBytes, grads_by_hook, group_state_bytes
from optimus.parallel.collectives import reduce_scatter_sum
from optimus.parallel.flat_buffer import FlatParams, Segment, same_start
from optimus.parallel.tensor_parallel import PARTIAL, SPLIT, local_grad

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Profiler ranges (torch.profiler.record_function) around the data-parallel collectives' launches and the waits for
# them, so that a profile tells a gradient reduction or a parameter gather from the step's other collectives and
# shows where the step blocks on one (benchmarks/overlap.py reads them).
GRAD_REDUCE, GRAD_REDUCE_WAIT = "optimus.grad_reduce", "optimus.grad_reduce.wait"
PARAM_GATHER, PARAM_GATHER_WAIT = "optimus.param_gather", "optimus.param_gather.wait"


@dataclass
class GroupComm:
    """Which ranks reduce and own one parameter group's gradients."""

    shard_group: Any
    shard_world: int
    shard_rank: int
    pre_group: Any = None  # all-reduced over before the reduce-scatter (replicated grads: none, standard's dense)
    pre_world: int = 1
    counts_in_norm: bool = True  # False where a peer owns the same elements (count each element once)
    # Hierarchical sharding (optim.shard_ranks): the ranks holding the same shard in the other shard groups, over
    # which the reduced shard is all-reduced after the reduce-scatter inside the shard group.
    replica_group: Any = None
    replica_world: int = 1


@dataclass
class TensorParallelGrads:
    """tp > 1, the dense group: the TP group and each parameter's role there (optimus.parallel.tensor_parallel:
    split slices are complete, partial gradients are summed over the TP group, replicated ones are counted
    once in the norm)."""

    group: Any
    rank: int
    roles: dict[str, str]


@dataclass
class OwnedSlice:
    """One bucket's slice of a group that this rank owns: what the update rule changes, and where it sits in the
    rank's shard of the group (`lo`, for the rule's own state of the same elements)."""

    group: str
    lo: int
    param: torch.Tensor  # fp32: the master copy, or the parameters themselves when they are fp32
    grad: torch.Tensor  # the reduced sum over the group's replicas, in optim.grad_dtype
    segments: list[Segment]  # runs of one weight-decay setting, in the slice's own coordinates


class ShardGroup:
    """One parameter group: flat params, gradient buffers and the fp32 master copy of the owned shard."""

    def __init__(
        self, named, comm: GroupComm, bucket: int, zero: int, grad_dtype, offsets, micro_batches: int, tp=None,
        grad_sinks: bool = True,
    ):  # fmt: skip
        """`bucket`: elements per bucket; `tp`: a TensorParallelGrads for the dense group of a tensor-parallel
        model, else None; `micro_batches`: backwards per step, hence gradient arrivals per parameter (ZeRO-2);
        `grad_sinks`: offer the fp32 sums to kernels that can add a weight's gradient into them themselves
        (optimus.kernels.grad_sink), where gradients would otherwise reach them by hook (offer_grad_sinks)."""
        self.comm, self.zero, self.tp, self.micro_batches = comm, zero, tp, micro_batches
        self.flat = FlatParams(named, comm.shard_world, comm.shard_rank, bucket, offsets)
        flat, dev = self.flat, self.flat.device
        self.grad_dtype = grad_dtype
        self.grads_by_hook = grads_by_hook(grad_dtype, flat.dtype, tensor_parallel=tp is not None)
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
        self.deferred: set[int] = set()  # ZeRO-2 slots whose gradient gets a contribution in reduce() (a tie)
        # Reductions in flight: (work, src, copy to, a shard to all-reduce over the replica groups once it is done).
        self.works: list[tuple[Any, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        self.replica_works: list[Any] = []  # hierarchical sharding: the shards' all-reduces in flight
        # Parameter all-gathers in flight, by bucket, and the order gather() starts them in (see gather_overlap).
        self.gathers: dict[int, tuple[Any, torch.Tensor]] = {}
        self.gather_order = list(range(len(self.flat.buckets)))
        self.bucket_slots = [
            [i for i, s in enumerate(flat.slots) if s.start < b.end and s.end > b.start] for b in flat.buckets
        ]
        if zero == 1 and not self.grads_by_hook:
            self.point_grads_at_buffer()
        self.offer_grad_sinks(grad_sinks)
        self.reset()

    # ---- bookkeeping --------------------------------------------------------

    def refresh_master(self) -> None:
        for b in self.flat.buckets:
            self.flat.shard_view(self.master, b).copy_(self.flat.owned_view(self.flat.buffer, b))

    def offer_grad_sinks(self, wanted: bool) -> None:
        """Offer each parameter a gradient sink where a fused kernel may add to it: fp32 gradients that hooks would
        otherwise add up, in the full buffer (ZeRO-1) or in the per-parameter sums of a step's micro-batches
        (ZeRO-2 with several: `sink_for`), in a group without tensor-parallel sums (`tp`: the dense group under tp)
        and a plain parameter (not a DTensor). Elsewhere take back an offer an earlier optimizer made."""
        fusable = wanted and self.grads_by_hook and self.tp is None and self.grad_dtype == torch.float32
        fusable = fusable and (self.zero == 1 or self.micro_batches > 1)
        for i, s in enumerate(self.flat.slots):
            plain = not isinstance(s.param, DTensor)
            grad_sink.attach(s.param, self if fusable and plain else None, i)

    def sink_for(self, slot_idx: int) -> torch.Tensor | None:
        """The flat fp32 sum of slot `slot_idx`'s gradients of this step, where a kernel adds the next one
        (grad_sink): its slice of the full buffer (ZeRO-1), or its sum of the step's micro-batches (ZeRO-2); None
        before ZeRO-2's first gradient of the step, which the kernel writes as a new sum (`adopt_sink_sum`)."""
        s = self.flat.slots[slot_idx]
        if self.zero == 1:
            return self.full_grad[s.start : s.end]
        return self.partial.get(slot_idx)

    def adopt_sink_sum(self, slot_idx: int, grad: torch.Tensor) -> None:
        """ZeRO-2: a kernel's fp32 gradient of slot `slot_idx`, flat, the step's first, kept as its sum (where the
        hook of the first gradient would have made it), so that the kernel neither zeroes a sum nor reads it."""
        s = self.flat.slots[slot_idx]
        fits = grad.dtype == self.grad_dtype and grad.numel() == s.end - s.start
        if self.zero != 2 or slot_idx in self.partial or not fits:
            raise RuntimeError(f"slot {slot_idx} cannot take a {grad.dtype} gradient of {grad.numel()} elements")
        self.partial[slot_idx] = grad

    def point_grads_at_buffer(self) -> None:
        for s in self.flat.slots:
            s.param.grad = self.full_grad[s.start : s.end].view_as(s.param)

    def reset(self) -> None:
        """A new step: no gradient has arrived, nothing is packed or staged."""
        self.left = [len(ids) for ids in self.bucket_slots]  # slots still to be packed, per bucket
        self.arrivals = [0] * len(self.flat.slots)  # ZeRO-2: gradients received this step, per slot
        self.packed = [False] * len(self.flat.slots)
        self.partial: dict[int, torch.Tensor] = {}  # ZeRO-2, grads_by_hook: slot -> sum of its earlier grads
        self.stale: set[int] = set()  # slots whose .grad autograd stored holds nothing we still need
        self.completed: dict[int, weakref.ref] = {}  # slot -> its complete gradient, until it is stored in .grad
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

    def arrive(self, slot_idx: int, grad: torch.Tensor) -> torch.Tensor | None:
        """ZeRO-2 (a tensor hook): slot `slot_idx`'s gradient of one micro-batch, before autograd stores it. The
        step's last one completes the gradient, which is packed for its reduction: kept in grad_dtype here
        (grads_by_hook) it is packed at once; else this hook returns the completed sum for autograd to store in
        .grad in its place, and it is packed from there (`stored`, or a weight pass's `collect_assigned`), so
        that, as with autograd's own accumulation, this micro-batch's gradient is not held beside the sum."""
        self.collect_assigned()
        self.arrivals[slot_idx] += 1
        if self.arrivals[slot_idx] > self.micro_batches:
            raise RuntimeError(
                f"{self.flat.slots[slot_idx].name} received more gradients than the step's {self.micro_batches} "
                "micro-batches: build the optimizer with the number of backwards per step."
            )
        last = self.arrivals[slot_idx] == self.micro_batches and slot_idx not in self.deferred
        param = self.flat.slots[slot_idx].param
        if self.grads_by_hook:
            # a kernel that added this gradient into the slot's sum (sink_for) hands autograd a placeholder
            grad = None if grad_sink.take_added(param) else local_grad(param, grad)
            if last:
                self.pack(slot_idx, grad, self.partial.pop(slot_idx, None))
            elif grad is not None:
                self.accumulate_partial(slot_idx, grad)
            self.stale.add(slot_idx)  # what autograd stores is taken already
            return None
        if not last:
            return None  # autograd accumulates it in .grad
        earlier, param.grad = param.grad, None
        total = grad if earlier is None else earlier.add_(grad)
        self.completed[slot_idx] = weakref.ref(total)  # no strong reference: autograd may take it without a copy
        return total

    def stored(self, slot_idx: int) -> None:
        """ZeRO-2 (a post-accumulate-grad hook, run by autograd's backward): pack a completed gradient, drop one
        already taken."""
        if slot_idx in self.stale:
            self.stale.discard(slot_idx)
            self.flat.slots[slot_idx].param.grad = None
        elif slot_idx in self.completed:
            self.pack_completed(slot_idx)

    def collect_assigned(self) -> None:
        """ZeRO-2: gradients a zero-bubble weight pass assigned to .grad since the last event (it runs no
        post-accumulate-grad hook): pack those completed, drop those taken. A slot stays stale until its .grad is
        assigned: a weight pass assigns its weights' gradients after all their hooks have run."""
        for i in [i for i in self.stale if self.flat.slots[i].param.grad is not None]:
            self.flat.slots[i].param.grad = None
            self.stale.discard(i)
        for i, ref in list(self.completed.items()):
            grad = self.flat.slots[i].param.grad
            if grad is not None and grad is ref():
                self.pack_completed(i)

    def pack_completed(self, slot_idx: int) -> None:
        del self.completed[slot_idx]
        param = self.flat.slots[slot_idx].param
        grad, param.grad = param.grad, None
        self.pack(slot_idx, grad, None)

    def earlier(self, slot_idx: int) -> torch.Tensor | None:
        """ZeRO-2: the sum of the step's gradients of a slot held so far (None if none: kept here, or in .grad by
        autograd or by hand), taken out of where it was held."""
        held = self.partial.pop(slot_idx, None)
        param = self.flat.slots[slot_idx].param
        grad, param.grad = local_grad(param), None
        if grad is not None:
            held = grad.reshape(-1) if held is None else held.add_(grad.reshape(-1))
        return held

    def add_to_gradient(self, slot_idx: int, extra: torch.Tensor) -> None:
        """Add `extra` to a slot's gradient of the step before its reduction (a tied weight's other use); after
        `collect()`, before `reduce_rest()`."""
        s = self.flat.slots[slot_idx]
        if self.zero == 1:
            self.full_grad[s.start : s.end].add_(extra.reshape(-1))
            return
        held = self.earlier(slot_idx)
        extra = extra.reshape(-1).to(self.grad_dtype)
        self.partial[slot_idx] = extra if held is None else held.to(self.grad_dtype).add_(extra)

    # ---- reduction ----------------------------------------------------------

    def pack(self, slot_idx: int, grad: torch.Tensor | None, earlier: torch.Tensor | None) -> None:
        """ZeRO-2: copy one parameter's gradient of the step (`grad` + `earlier`) into the staging copy of each
        bucket it overlaps; launch the buckets this completes."""
        s = self.flat.slots[slot_idx]
        self.packed[slot_idx] = True
        if self.tp_partial[slot_idx]:  # this rank's share of a sum over the tp ranks: complete it first
            grad, earlier = self.sum_over_tp(slot_idx, grad, earlier), None
        for bi, b in enumerate(self.flat.buckets):
            if s.end <= b.start or s.start >= b.end:
                continue
            if bi < self.next_launch:
                raise RuntimeError(f"the gradient of {s.name} arrived after its bucket was reduced.")
            if bi not in self.staging:
                self.staging[bi] = self.new_staging(bi)
            lo, hi = max(s.start, b.start), min(s.end, b.end)
            dst = self.staging[bi][lo - b.start : hi - b.start]
            if grad is not None:
                dst.copy_(grad.reshape(-1)[lo - s.start : hi - s.start])
            if earlier is not None and grad is not None:
                dst.add_(earlier.reshape(-1)[lo - s.start : hi - s.start])
            elif earlier is not None:  # the whole sum (a kernel added this micro-batch's gradient to it)
                dst.copy_(earlier.reshape(-1)[lo - s.start : hi - s.start])
            elif grad is None:  # no gradient this step (a parameter the loss did not reach)
                dst.zero_()
            self.left[bi] -= 1
            if self.left[bi] == 0:  # reduce it before staging the next: a large parameter spans many buckets
                self.launch_ready()

    def new_staging(self, bucket_idx: int) -> torch.Tensor:
        """ZeRO-2: an uninitialised staging copy of one bucket [numel] with its padding (the elements after the last
        slot: slots tile the flat buffer from its start) zeroed; pack writes every slot's part. Zeroing the whole
        bucket first would write it twice: on a 220B rank, nine 1 GiB buckets a step."""
        b = self.flat.buckets[bucket_idx]
        staged = torch.empty(b.end - b.start, dtype=self.grad_dtype, device=self.flat.device)  # [numel]
        staged[max(self.flat.numel, b.start) - b.start :].zero_()
        return staged

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
        """Wait for the oldest reduction in flight and drop its buffers (ZeRO-2: the staged bucket); with replica
        groups, start the all-reduce of its shard over them (it holds no staged buffer, so it is not counted in
        BUCKETS_IN_FLIGHT)."""
        work, src, copy_to, shard = self.works.pop(0)
        with record_function(GRAD_REDUCE_WAIT):
            work.wait()
        if copy_to is not None:
            copy_to.copy_(src)
        if shard is not None:  # here, where every rank issues it in the same order among its other collectives (not
            # when its reduce-scatter happens to finish: ranks that order two groups' collectives differently can
            # deadlock on a GPU, where each communicator's collectives run in issue order)
            with record_function(GRAD_REDUCE):
                self.replica_works.append(dist.all_reduce(shard, group=self.comm.replica_group, async_op=True))

    def launch(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Start reducing one bucket's gradient `src` into this rank's shard of it, `out`: the sum over every
        replica of the global batch, in grad_dtype."""
        with record_function(GRAD_REDUCE):
            self._launch(src, out)

    def _launch(self, src: torch.Tensor, out: torch.Tensor) -> None:
        c = self.comm
        if c.shard_world == 1:  # one owner: all-reduces over the replicas, if any, into src; then src -> out
            copy_to = None if same_start(out, src) else out
            groups = [g for g, n in ((c.pre_group, c.pre_world), (c.replica_group, c.replica_world)) if n > 1]
            for group in groups[:-1]:  # standard's dense with optim.shard_ranks=1: over EP first
                dist.all_reduce(src, group=group)
            if groups:
                self.works.append((dist.all_reduce(src, group=groups[-1], async_op=True), src, copy_to, None))
            elif copy_to is not None:
                copy_to.copy_(src)
            return
        if c.pre_world > 1:  # the standard scheme's all-reduce over EP, before the DP reduce-scatter
            dist.all_reduce(src, group=c.pre_group)
        replicas = out if c.replica_world > 1 else None  # hierarchical: the shard group's sums, then the replicas'
        self.works.append((reduce_scatter_sum(out, src, c.shard_group, async_op=True), src, None, replicas))

    def collect(self) -> None:
        """After the backwards: bring every gradient of the step into this group's buffers (a .grad that was set by
        hand or by a zero-bubble weight pass rather than accumulated by autograd)."""
        if self.zero == 2:
            self.collect_assigned()
            return
        if self.grads_by_hook:
            for i, s in enumerate(self.flat.slots):
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
                elif not same_start(s.param.grad, view):
                    view.copy_(s.param.grad)

    def reduce_rest(self) -> None:
        """Launch the reductions the backwards did not (ZeRO-1: all of them; ZeRO-2: those of gradients that no
        last arrival completed, such as a parameter that missed a micro-batch) and wait for all in flight."""
        if self.zero == 2:
            for i in range(len(self.flat.slots)):
                if not self.packed[i]:
                    self.pack(i, None, self.earlier(i))
        self.launch_ready(force=True)
        while self.works:
            self.finish_oldest()
        with record_function(GRAD_REDUCE_WAIT):
            for work in self.replica_works:
                work.wait()
        self.replica_works.clear()

    def zero_grad(self) -> None:
        if self.zero == 1:
            self.full_grad.zero_()
            if not self.grads_by_hook:
                self.point_grads_at_buffer()
        if self.zero == 2 or self.grads_by_hook:
            for s in self.flat.slots:
                s.param.grad = None
                grad_sink.forget(s.param)  # a backward stopped before its hook leaves nothing behind
        self.reset()

    # ---- after the reduction --------------------------------------------------

    def sq_norm(self) -> torch.Tensor:
        """fp64 squared norm of the owned shard of the summed gradient (zero where a peer counts it)."""
        if not self.comm.counts_in_norm:
            return torch.zeros((), dtype=torch.float64, device=self.flat.device)
        if self.tp is not None and self.tp.rank > 0:  # tp rank 0 counts what the tp ranks share
            own = [r for r in self.flat.owned_ranges if self.tp.roles.get(r.name) == SPLIT]
            return sum_of_squares([self.grad_shard[r.shard_lo : r.shard_hi] for r in own], self.flat.device)
        return sum_of_squares([self.grad_shard], self.flat.device)

    def owned_slices(self, kind: str) -> Iterator[OwnedSlice]:
        flat, sv = self.flat, self.flat.shard_view
        for b, segments in zip(flat.buckets, flat.segments):
            param = sv(self.master, b) if self.master is not None else flat.owned_view(flat.buffer, b)
            yield OwnedSlice(kind, b.shard_offset, param, sv(self.grad_shard, b), segments)

    def exchange_shard(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """One all_to_all over the group's owner ranks: `send_counts[r]` elements of `send` (consecutive, in rank
        order) to each rank r; returns the `recv_counts[r]` elements from each, in rank order. An update rule that
        needs whole matrices (Muon, optimus.optim.muon_exchange) moves them with it."""
        received = send.new_empty(sum(recv_counts))
        dist.all_to_all_single(received, send, recv_counts, send_counts, group=self.comm.shard_group)
        return received

    def tp_world(self) -> int:
        return 1 if self.tp is None else dist.get_world_size(self.tp.group)

    def all_gather_tp(self, x_N: torch.Tensor) -> torch.Tensor:
        """[tp, N]: every tensor-parallel peer's `x_N`, in tp-rank order (the dense group of a tp > 1 model)."""
        out = x_N.new_empty(self.tp_world() * x_N.numel())
        _all_gather(out, x_N.contiguous(), group=self.tp.group)
        return out.view(self.tp_world(), -1)

    def gather_params(self) -> None:
        """Start all-gathering every rank's updated slices into the flat parameter buffer (hence into the
        parameters), bucket by bucket in `gather_order`; `wait_gathered` finishes them."""
        flat, c = self.flat, self.comm
        # Into the buffer through `.data`, whose version counter is its own: gloo bumps the output's counter when a
        # gather completes (on its own thread), every parameter viewing the buffer shares the buffer's counter, and
        # so with overlap_param_gather a bucket landing after an earlier block's forward failed that block's
        # backward ("modified by an inplace operation") although none of the values it read changed: each block
        # waits for its own buckets before it reads them.
        received = flat.buffer.data
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
            with record_function(PARAM_GATHER):
                work = _all_gather(received[b.start : b.end], mine, group=c.shard_group, async_op=True)
            self.gathers[bi] = (work, mine)  # `mine` is kept until the collective has read it

    def wait_gathered(self, buckets: Iterable[int] | None = None) -> None:
        """Finish the all-gathers of `buckets` (of every bucket when None) that are still in flight."""
        for bi in list(self.gathers) if buckets is None else buckets:
            entry = self.gathers.pop(bi, None)
            if entry is not None:
                with record_function(PARAM_GATHER_WAIT):
                    entry[0].wait()

    def state_bytes(self, state_bytes_per_element: int) -> StateBytes:
        es, gs = self.flat.buffer.element_size(), self.grad_shard.element_size()
        return group_state_bytes(self.flat.numel, self.comm.shard_world, es, gs, self.zero, state_bytes_per_element)
