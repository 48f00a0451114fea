"""Sharded AdamW (ZeRO-1 / ZeRO-2) that knows about expert parallelism.

Two parameter groups, each in flat buffers (optimus.optim.flat_buffer):

    scheme     dense grads                                    dense state   expert grads / state
    ep_aware   reduce-scatter over the world (DP x EP)        1/world       reduce-scatter over EDP, 1/DP
    standard   all-reduce over EP, reduce-scatter over DP     1/DP          reduce-scatter over EDP, 1/DP

Reductions SUM and then divide by the world size, so the update is the one for
the mean loss over the global batch (an expert's local grad already holds every
EP peer's tokens through the dispatcher's backward). After the update each
rank's owned slices are all-gathered back into the parameters over the group
that sharded them.

ZeRO-1 keeps full gradient buffers (parameters' .grad are views into them) and
reduces in step(). ZeRO-2 reduces each bucket from post-accumulate-grad hooks
during the backward of the last micro-batch (async, waited on in step()) and
keeps only the owned gradient shard between steps.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from optimus.config import OptimConfig
from optimus.model.counts import is_expert_param
from optimus.optim.adamw import AdamWHyper, adamw_update
from optimus.optim.flat_buffer import FlatParams
from optimus.optim.grad_norm import clip_coefficient, global_grad_norm
from optimus.parallel import ParallelState

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

ALIGN_BYTES = 128  # every rank's slice of a bucket starts on a 128-byte boundary
SCHEMES = ("ep_aware", "standard")


@dataclass
class GroupComm:
    """Which ranks reduce and own one parameter group's gradients."""

    shard_group: Any
    shard_world: int
    shard_rank: int
    pre_group: Any = None  # all-reduced over before the reduce-scatter (standard: dense grads over EP)
    pre_world: int = 1
    counts_in_norm: bool = True  # False where a peer owns the same shard (standard, dense, ep_rank > 0)


def group_comms(ps: ParallelState, scheme: str) -> dict[str, GroupComm]:
    expert = GroupComm(ps.edp_group, ps.dp, ps.dp_rank)
    if scheme == "ep_aware":
        dense = GroupComm(ps.world_group, ps.world_size, ps.rank)
    else:
        dense = GroupComm(ps.edp_group, ps.dp, ps.dp_rank, ps.ep_group, ps.ep, ps.ep_rank == 0)
    return {"dense": dense, "expert": expert}


def expert_global_offsets(model: torch.nn.Module, names: list[str], ep: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Expert params: (first element in the tensor of all E experts, full shape), from the module's expert_offset."""
    out = {}
    for name in names:
        module_name, _, attr = name.rpartition(".")
        param = getattr(model.get_submodule(module_name), attr)
        offset = getattr(model.get_submodule(module_name), "expert_offset", 0)
        per_expert = param[0].numel() if param.dim() else 1
        out[name] = (offset * per_expert, (param.shape[0] * ep, *param.shape[1:]))
    return out


class ShardGroup:
    """One parameter group: flat params, gradient buffers, fp32 shards and AdamW moments."""

    def __init__(self, named, comm: GroupComm, bucket_bytes: int, max_numel: int, zero: int, global_offsets):
        self.comm, self.zero = comm, zero
        es = named[0][1].element_size()
        bucket_numel = min(max_numel, bucket_bytes // es)
        self.flat = FlatParams(
            named, comm.shard_world, comm.shard_rank, bucket_numel, max(1, ALIGN_BYTES // es), global_offsets
        )
        flat, dev = self.flat, self.flat.device
        self.dtype = flat.dtype
        self.grad_shard = torch.zeros(flat.shard_numel, dtype=self.dtype, device=dev)  # reduced, owned
        self.master = None  # fp32 copy of the owned slices when params are lower precision
        if self.dtype != torch.float32:
            self.master = torch.empty(flat.shard_numel, dtype=torch.float32, device=dev)
            self.refresh_master()
        self.exp_avg = torch.zeros(flat.shard_numel, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(flat.shard_numel, dtype=torch.float32, device=dev)
        self.full_grad = None
        if zero == 1:
            self.full_grad = torch.zeros(flat.padded_numel, dtype=self.dtype, device=dev)  # [N_pad]
            self.point_grads_at_buffer()
        self.works: list[tuple[Any, torch.Tensor]] = []  # in-flight reductions and the tensors they read
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

    # ---- reduction ----------------------------------------------------------

    def pack(self, slot_idx: int, grad: torch.Tensor | None) -> None:
        """ZeRO-2: copy one parameter's final local grad into the staging copy of each bucket it overlaps."""
        s = self.flat.slots[slot_idx]
        self.packed[slot_idx] = True
        for bi, b in enumerate(self.flat.buckets):
            if s.end <= b.start or s.start >= b.end:
                continue
            if bi < self.next_launch:
                raise RuntimeError(
                    f"the gradient of {s.name} arrived after its bucket was reduced: call "
                    "optimizer.set_last_micro_batch(False) before the backward of every micro-batch but the last."
                )
            if bi not in self.staging:
                self.staging[bi] = torch.zeros(b.end - b.start, dtype=self.dtype, device=self.flat.device)
            lo, hi = max(s.start, b.start), min(s.end, b.end)
            if grad is not None:
                self.staging[bi][lo - b.start : hi - b.start].copy_(grad.reshape(-1)[lo - s.start : hi - s.start])
            self.left[bi] -= 1

    def launch_ready(self, force: bool = False) -> None:
        """Start reductions of finished buckets, strictly in bucket order so every rank issues the same sequence."""
        while self.next_launch < len(self.flat.buckets) and (force or self.left[self.next_launch] == 0):
            bi = self.next_launch
            b = self.flat.buckets[bi]
            src = self.full_grad[b.start : b.end] if self.zero == 1 else self.staging.pop(bi)
            self.launch(src, self.flat.shard_view(self.grad_shard, b))
            self.next_launch += 1

    def launch(self, src: torch.Tensor, out: torch.Tensor) -> None:
        c = self.comm
        if c.pre_world > 1:  # the standard scheme's all-reduce over EP, before the DP reduce-scatter
            dist.all_reduce(src, group=c.pre_group)
        if c.shard_world == 1:
            out.copy_(src)
            return
        self.works.append((_reduce_scatter(out, src, group=c.shard_group, async_op=True), src))

    def finish_reduction(self) -> None:
        if self.zero == 2:
            for i, s in enumerate(
                self.flat.slots
            ):  # grads the hooks did not see (e.g. params unused in the last micro-batch)
                if not self.packed[i]:
                    self.pack(i, s.param.grad)
                    s.param.grad = None
        else:
            for s in self.flat.slots:  # someone replaced or dropped a .grad view: bring it back into the buffer
                view = self.full_grad[s.start : s.end].view_as(s.param)
                if s.param.grad is None:
                    view.zero_()
                elif s.param.grad.data_ptr() != view.data_ptr():
                    view.copy_(s.param.grad)
        self.launch_ready(force=True)
        for work, _ in self.works:
            work.wait()
        self.works.clear()

    def zero_grad(self) -> None:
        if self.zero == 1:
            self.full_grad.zero_()
            self.point_grads_at_buffer()
        else:
            for s in self.flat.slots:
                s.param.grad = None
        self.reset_buckets()

    # ---- update -------------------------------------------------------------

    def sq_norm(self, world_size: int) -> torch.Tensor:
        """Squared norm of the owned shard of the averaged gradient (fp32 accumulation, no fp32 copy)."""
        if not self.comm.counts_in_norm:
            return torch.zeros((), device=self.flat.device)
        return (torch.linalg.vector_norm(self.grad_shard, dtype=torch.float32) / world_size).square()

    def update(self, lr: float, step: int, grad_scale: float, h: AdamWHyper) -> None:
        flat, sv = self.flat, self.flat.shard_view
        for b, segments in zip(flat.buckets, flat.segments):
            param = sv(self.master, b) if self.master is not None else flat.owned_view(flat.buffer, b)
            grad, m, v = sv(self.grad_shard, b), sv(self.exp_avg, b), sv(self.exp_avg_sq, b)
            adamw_update(segments, param, grad, m, v, lr, step, h, grad_scale)

    def gather_params(self) -> None:
        """All-gather every rank's updated slices into the flat parameter buffer (hence into the parameters)."""
        flat, c = self.flat, self.comm
        works = []
        for b in flat.buckets:
            if self.master is not None:
                mine = flat.shard_view(self.master, b).to(self.dtype)
                if c.shard_world == 1:
                    flat.buffer[b.start : b.end].copy_(mine)
                    continue
            elif c.shard_world == 1:
                continue
            else:
                mine = flat.owned_view(flat.buffer, b).clone()
            works.append((_all_gather(flat.buffer[b.start : b.end], mine, group=c.shard_group, async_op=True), mine))
        for work, _ in works:
            work.wait()


class ShardedAdamW:
    """`optim.sharding=ep_aware | standard`: sharded AdamW with the interface of ReplicatedAdamW."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, ps: ParallelState, grad_clip: float, scheme: str):
        if scheme not in SCHEMES:
            raise ValueError(f"unknown sharding scheme {scheme!r}; expected one of {SCHEMES}")
        self.ps, self.scheme, self.grad_clip, self.zero = ps, scheme, grad_clip, cfg.zero
        self.hyper = AdamWHyper(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay)
        self.step_count = 0
        self.last_micro_batch = True
        self.timers = None  # profile.timers: the trainer hands in its optimus.train.timers.Timers
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        by_kind = {
            "dense": [(n, p) for n, p in named if not is_expert_param(n)],
            "expert": [(n, p) for n, p in named if is_expert_param(n)],
        }
        comms = group_comms(ps, scheme)
        bucket_bytes = int(cfg.bucket_mb * 2**20) if cfg.zero == 2 else 2**62  # ZeRO-1: only the size limit cuts
        self.groups: dict[str, ShardGroup] = {}
        for kind, params in by_kind.items():
            if not params:
                continue
            offsets = expert_global_offsets(model, [n for n, _ in params], ps.ep) if kind == "expert" else None
            self.groups[kind] = ShardGroup(
                params, comms[kind], bucket_bytes, cfg.max_collective_numel, cfg.zero, offsets
            )
        if cfg.zero == 2:
            for group in self.groups.values():
                for i, s in enumerate(group.flat.slots):
                    s.param.register_post_accumulate_grad_hook(self._hook(group, i))

    def _hook(self, group: ShardGroup, slot_idx: int):
        def hook(param: torch.Tensor) -> None:
            if not self.last_micro_batch:
                return  # keep accumulating locally; only the last micro-batch reduces
            group.pack(slot_idx, param.grad)
            param.grad = None  # ZeRO-2 keeps only the owned shard
            group.launch_ready()

        return hook

    def set_last_micro_batch(self, is_last: bool) -> None:
        """Tell ZeRO-2 whether the coming backward is the last of this optimizer step (it reduces then)."""
        self.last_micro_batch = is_last

    def zero_grad(self) -> None:
        for group in self.groups.values():
            group.zero_grad()

    def step(self, lr: float) -> float:
        """Reduce, clip and apply the gradients; returns the pre-clip global norm (no update if it is not finite)."""
        groups, world = list(self.groups.values()), self.ps.world_size
        timed = self.timers if self.timers else (lambda name: nullcontext())  # profile.timers
        with timed("grad_reduce"):  # ZeRO-2: only the part not hidden behind the backward
            for group in groups:
                group.finish_reduction()  # grad shards now hold SUMS over the ranks; the mean is sum / world
        norm = global_grad_norm([g.sq_norm(world) for g in groups], self.ps.world_group, self.ps.is_distributed)
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
        return norm

    # ---- reporting and checkpoints -------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """Persistent bytes on this rank; padding = bytes held beyond an even split of the real elements."""
        out = {"param_bytes": 0, "grad_bytes": 0, "optim_state_bytes": 0, "padding_bytes": 0.0}
        for g in self.groups.values():
            flat, es = g.flat, g.flat.buffer.element_size()
            state_per_elem = 8 + (4 if g.master is not None else 0)
            out["param_bytes"] += flat.padded_numel * es
            out["grad_bytes"] += flat.shard_numel * es + (flat.padded_numel * es if g.full_grad is not None else 0)
            out["optim_state_bytes"] += flat.shard_numel * state_per_elem
            full_buffers = 2 if g.full_grad is not None else 1
            out["padding_bytes"] += flat.padding * (full_buffers * es + (es + state_per_elem) / flat.world)
        out["padding_bytes"] = math.ceil(out["padding_bytes"])
        return out

    def state_dict(self) -> dict:
        """Moments (and fp32 master) of every owned range, keyed "name[lo:hi]" in the full parameter's flat index."""
        shards = {}
        for g in self.groups.values():
            for r in g.flat.owned_ranges:
                entry = {
                    "name": r.name, "lo": r.global_lo, "hi": r.global_hi, "shape": list(r.global_shape),
                    "exp_avg": g.exp_avg[r.shard_lo : r.shard_hi].clone(),
                    "exp_avg_sq": g.exp_avg_sq[r.shard_lo : r.shard_hi].clone(),
                }  # fmt: skip
                if g.master is not None:
                    entry["master"] = g.master[r.shard_lo : r.shard_hi].clone()
                shards[f"{r.name}[{r.global_lo}:{r.global_hi}]"] = entry
        return {"step": self.step_count, "scheme": self.scheme, "shards": shards}

    def load_state_dict(self, state: dict) -> None:
        """Fill every owned range from the saved shards that overlap it (any layout, as long as they cover it)."""
        by_name: dict[str, list[dict]] = {}
        for entry in state["shards"].values():
            by_name.setdefault(entry["name"], []).append(entry)
        for g in self.groups.values():
            if g.master is not None:
                g.refresh_master()  # for ranges saved without a master copy (an fp32 run)
            for r in g.flat.owned_ranges:
                covered = 0
                for e in by_name.get(r.name, []):
                    lo, hi = max(r.global_lo, e["lo"]), min(r.global_hi, e["hi"])
                    if lo >= hi:
                        continue
                    dst = slice(r.shard_lo + lo - r.global_lo, r.shard_lo + hi - r.global_lo)
                    src = slice(lo - e["lo"], hi - e["lo"])
                    g.exp_avg[dst].copy_(e["exp_avg"][src])
                    g.exp_avg_sq[dst].copy_(e["exp_avg_sq"][src])
                    if g.master is not None and "master" in e:
                        g.master[dst].copy_(e["master"][src])
                    covered += hi - lo
                if covered != r.global_hi - r.global_lo:
                    raise ValueError(
                        f"the optimizer state does not cover elements [{r.global_lo}, {r.global_hi}) of {r.name}: "
                        "load a checkpoint saved from a model of the same shape, with the shards of every rank."
                    )
        self.step_count = int(state["step"])
