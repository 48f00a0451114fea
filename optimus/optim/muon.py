"""Muon on the sharder's owned slices: hidden matrices orthogonalised whole, everything else AdamW.

Which parameters Muon takes (`takes_muon`, `unit_blocks`), as nn.Linear weights [out, in]:

    attention wq, wk, wv, wo; dense and shared-expert w1, w3, w2     one matrix each
    routed experts w13 [E, D, 2F]                                     per expert: gate [F, D] and up [F, D]
    routed experts w2 [E, F, D]                                       per expert: down [D, F]

and AdamW the rest: the embedding and the LM head (a lookup table and a classifier, whose rows are tokens, not
directions of a hidden space), norms (vectors), and the router. The router is a classifier over experts too: its
E rows are the experts' directions in the hidden space, and orthogonalising them at every step would fix their
norms, hence the logits' scale that the z-loss and the balancing losses act on. w13's gate and up halves are
separate matrices, as in the models Optimus imports (gate_proj, up_proj): orthogonalising the pair as one [2F, D]
matrix would couple two maps that SwiGLU multiplies, not adds.

One step (torch.optim.Muon's arithmetic, on fp32):

    1. each rank, on the elements it owns: momentum m <- lerp(m, g, 1 - mu); u = lerp(g, m, mu) (Nesterov) or m
       (AdamW on the other elements);
    2. each unit of work (a matrix, or one expert's matrices) has one owner among the group's ranks, and the
       pieces of its u that other ranks hold travel to it (optimus.optim.muon_exchange: an all-to-all, nothing
       with one owner or when no unit straddles two ranks' slices);
    3. the owner orthogonalises its units (Newton-Schulz, in bf16 as torch does; batched by shape; a matrix
       that tensor parallelism splits is first made whole from its tp peers' halves, and each keeps its half of
       the result) and scales them by the adjusted learning rate;
    4. the updates travel back to the ranks holding the pieces (the reverse all-to-all), and each applies its
       own: p <- p (1 - lr wd) - lr_adjusted O.

The momentum lives in the AdamW first-moment slot of the same elements, and the second-moment slot of Muon's
elements stays zero, so checkpoints key both rules' state alike (optimus.optim.state_ranges).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch

from optimus.optim.adamw import AdamW, AdamWHyper, adamw_update
from optimus.optim.memory import MUON_DIRECTION_BYTES, muon_group_work_bytes
from optimus.optim.muon_exchange import EXPERT_W2, EXPERT_W13, MuonExchange
from optimus.parallel.flat_buffer import FlatParams, ParamSlot, Segment
from optimus.parallel.tensor_parallel import SPLIT

NOT_MUON = ("embed.weight", "lm_head.weight", "router.gate.weight")
NS_EPS = 1e-7  # torch.optim.Muon's
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic (a, b, c)


@dataclass
class MuonHyper:
    momentum: float
    nesterov: bool
    ns_steps: int
    ns_coefficients: tuple[float, float, float]
    adjust_lr: str  # original | match_rms_adamw (torch.optim.Muon's adjust_lr_fn)
    ns_dtype: torch.dtype = torch.bfloat16  # the iteration's (optim.muon_ns_dtype)


def takes_muon(name: str, ndim: int) -> bool:
    """Whether Muon updates parameter `name` (AdamW does otherwise): see the module docstring."""
    return ndim >= 2 and not name.endswith(NOT_MUON)


def unit_blocks(slot: ParamSlot, unit: torch.Tensor) -> list[torch.Tensor]:
    """The [out, in] matrices of one unit of `slot` (optimus.optim.muon_exchange.units_of), from `unit`, its
    elements flat in the parameter's layout: a routed expert's gate and up, or its down; else the matrix."""
    if slot.name.endswith(EXPERT_W13):
        d, two_f = slot.local.shape[1:]
        x = unit.view(d, two_f)
        return [x[:, : two_f // 2].T, x[:, two_f // 2 :].T]  # gate, up: [F, D] each
    if slot.name.endswith(EXPERT_W2):
        return [unit.view(slot.local.shape[1:]).T]  # [F, D] -> down [D, F]
    return [unit.view(slot.local.shape)]


def lr_ratio(shape: tuple[int, int], adjust: str) -> float:
    """torch.optim.Muon's learning-rate adjustment for an [A, B] matrix."""
    a, b = shape
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return math.sqrt(max(1.0, a / b))


def newton_schulz(
    x_BMN: torch.Tensor, steps: int, coefficients: tuple[float, float, float], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration, in `dtype` (torch's: bf16), on a batch of same-shape
    matrices."""
    a, b, c = coefficients
    tall = x_BMN.shape[-2] > x_BMN.shape[-1]
    x = x_BMN.to(dtype)
    if tall:
        x = x.transpose(-2, -1)
    x = x / x.flatten(1).norm(dim=1).clamp(min=NS_EPS).view(-1, 1, 1)
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.transpose(-2, -1) if tall else x


class Muon(AdamW):
    """Muon for the matrices `takes_muon` names, AdamW for the rest, on a sharder's owned slices (the state of
    both lives in AdamW's two flat moments, see the module docstring)."""

    name = "muon"

    def __init__(self, hyper: MuonHyper, adamw: AdamWHyper, shard_numels: dict[str, tuple[int, torch.device]]):
        super().__init__(adamw, shard_numels)
        self.muon = hyper
        self._exchanges: dict[str, MuonExchange | None] = {}

    def exchange(self, kind: str, group) -> MuonExchange | None:
        """The group's units, owners and exchanges (optimus.optim.muon_exchange), None without a Muon matrix;
        planned once, from the layout."""
        if kind not in self._exchanges:
            slots = muon_slots_of(group.flat)
            self._exchanges[kind] = MuonExchange(group.flat, slots) if slots else None
        return self._exchanges[kind]

    def step_bytes(self, sharder) -> tuple[int, int]:
        """(working bytes, bytes received by its exchanges and tp gathers) of one step on this rank, from its
        plan: the largest group's working memory (optimus.optim.memory.muon_group_work_bytes says what is held),
        the groups' receipts summed."""
        work = received = 0
        for kind, group in sharder.groups.items():
            plan = self.exchange(kind, group)
            if plan is None:
                continue
            tp = group.tp_world()
            split = sum(u.numel for u in plan.owned if tp_split_dim(group, u.slot) is not None)
            batches = batch_shapes(plan.owned, partial(tp_split_dim, group), tp)
            exchanged = plan.received_numel()
            shard = group.flat.shard_numel
            ns_bytes = self.muon.ns_dtype.itemsize
            work = max(work, muon_group_work_bytes(shard, plan.buf_numel, exchanged, split, tp, batches, ns_bytes))
            received += (exchanged + (tp - 1) * split) * MUON_DIRECTION_BYTES
        return work, received

    def step(self, sharder, lr: float, step: int, grad_scale: float) -> None:
        for kind, group in sharder.groups.items():
            self._step_group(kind, group, lr, step, grad_scale)  # its buffers are freed before the next group's

    def _step_group(self, kind: str, group, lr: float, step: int, grad_scale: float) -> None:
        flat, plan = group.flat, self.exchange(kind, group)
        slots = plan.slots if plan else []
        u_shard = torch.zeros(flat.shard_numel if plan else 0, dtype=torch.float32, device=flat.device)
        muon_runs = []  # per owned slice: (slice, Muon's runs in it)
        for owned, bucket in zip(group.owned_slices(kind), flat.buckets):
            lo, hi = bucket.owned(flat.world, flat.rank)
            runs, adamw_runs = split_runs(owned.segments, slots, lo, hi)
            m, v = (self.state[kind][k][owned.lo : owned.lo + hi - lo] for k in self.state_kinds)
            adamw_update(adamw_runs, owned.param, owned.grad, m, v, lr, step, self.hyper, grad_scale)
            u = u_shard[owned.lo : owned.lo + hi - lo]
            for a, z in runs:
                self._momentum(owned.grad[a:z], m[a:z], u[a:z], grad_scale)
            muon_runs.append((owned, runs))
        if plan is None:
            return
        units = plan.gather(u_shard, group.exchange_shard)  # [owned units' elements]
        self._orthogonalise(plan, units, group, lr)
        plan.scatter(units, u_shard, group.exchange_shard)  # u_shard now holds the scaled updates
        decay = 1 - lr * self.hyper.weight_decay  # AdamW's decoupled decay, the same key
        for owned, runs in muon_runs:
            u = u_shard[owned.lo : owned.lo + owned.param.numel()]
            for a, z in runs:
                owned.param[a:z].mul_(decay).sub_(u[a:z])

    def _momentum(self, grad: torch.Tensor, m: torch.Tensor, u: torch.Tensor, grad_scale: float) -> None:
        g = grad.float() * grad_scale
        m.lerp_(g, 1 - self.muon.momentum)
        u.copy_(torch.lerp(g, m, self.muon.momentum) if self.muon.nesterov else m)

    def _orthogonalise(self, plan: MuonExchange, units: torch.Tensor, group, lr: float) -> None:
        """Replace each owned unit's direction in `units` by its orthogonalised update times the learning rate;
        matrices batched by shape, tensor-parallel halves made whole first."""
        pending: dict[tuple[int, int], list] = defaultdict(list)  # shape -> [(matrix, where its result goes)]
        split_units = [u for u in plan.owned if tp_split_dim(group, u.slot) is not None]
        if split_units:  # every tp peer owns the same units (the same layout): one all-gather for all of them
            mine = torch.cat([units[u.buf_lo : u.buf_lo + u.numel] for u in split_units])
            peers_TN = group.all_gather_tp(mine)  # [tp, owned split elements]
            offset = 0
            for u in split_units:
                dim, local = tp_split_dim(group, u.slot), u.slot.local.shape
                halves = [peers_TN[t, offset : offset + u.numel].view(local) for t in range(peers_TN.shape[0])]
                whole = torch.cat(halves, dim=dim)
                pending[tuple(whole.shape)].append((whole, (units[u.buf_lo : u.buf_lo + u.numel].view(local), dim)))
                offset += u.numel
        for u in plan.owned:
            if tp_split_dim(group, u.slot) is None:
                for block in unit_blocks(u.slot, units[u.buf_lo : u.buf_lo + u.numel]):
                    pending[tuple(block.shape)].append((block, (block, None)))
        tp_rank = group.tp.rank if group.tp is not None else 0
        for shape, items in pending.items():
            self._orthogonalise_batch(shape, items, lr, tp_rank)  # its stack and result freed before the next

    def _orthogonalise_batch(self, shape: tuple[int, int], items: list, lr: float, tp_rank: int) -> None:
        """One Newton-Schulz call on the matrices of one shape, each result written (scaled) where `items` say."""
        stack_BMN = torch.stack([m for m, _ in items])
        o_BMN = newton_schulz(stack_BMN, self.muon.ns_steps, self.muon.ns_coefficients, self.muon.ns_dtype)
        ratio = lr * lr_ratio(shape, self.muon.adjust_lr)
        for (_, (out, dim)), o in zip(items, o_BMN):
            if dim is not None:  # this rank's half of the whole matrix's update
                o = o.narrow(dim, tp_rank * out.shape[dim], out.shape[dim])
            out.copy_(o.float()).mul_(ratio)


def tp_split_dim(group, slot: ParamSlot) -> int | None:
    """The dimension tensor parallelism splits `slot` along (0: rows, 1: columns), None if it is whole here."""
    if group.tp is None or group.tp.roles.get(slot.name) != SPLIT:
        return None
    return 1 if slot.cols is not None else 0


def batch_shapes(units: Iterable, split_dim: Callable[[ParamSlot], int | None], tp: int) -> Counter:
    """How many matrices of each shape the orthogonalisation of `units` (each with a .slot and a .numel: owned
    Units, or the Placements of optimus.optim.muon_exchange) stacks into one Newton-Schulz batch: a unit's
    blocks (unit_blocks, read on the meta device), or, for a matrix that tensor parallelism splits along
    `split_dim(slot)`, the whole matrix of its `tp` peers' halves."""
    shapes: Counter = Counter()
    for u in units:
        dim = split_dim(u.slot)
        if dim is None:
            shapes.update(tuple(b.shape) for b in unit_blocks(u.slot, torch.empty(u.numel, device="meta")))
        else:
            whole = list(u.slot.local.shape)
            whole[dim] *= tp
            shapes[tuple(whole)] += 1
    return shapes


def muon_slots_of(flat: FlatParams) -> list[ParamSlot]:
    return [s for s in flat.slots if takes_muon(s.name, s.local.dim())]


def overlap(slot: ParamSlot, lo: int, hi: int) -> bool:
    return slot.start < hi and lo < slot.end


def split_runs(segments: list[Segment], muon_slots: list[ParamSlot], lo: int, hi: int):
    """A bucket's owned slice [lo, hi) cut into Muon runs [(a, z)] and AdamW segments, in slice coordinates."""
    muon = sorted((max(lo, s.start) - lo, min(hi, s.end) - lo) for s in muon_slots if overlap(s, lo, hi))
    adamw = []
    for seg in segments:
        cursor = seg.lo
        for a, z in muon:
            if z <= cursor or a >= seg.hi:
                continue
            if a > cursor:
                adamw.append(Segment(cursor, a, seg.weight_decay))
            cursor = max(cursor, z)
        if cursor < seg.hi:
            adamw.append(Segment(cursor, seg.hi, seg.weight_decay))
    return muon, adamw
