"""Muon on the sharder's owned slices: hidden matrices orthogonalised whole, everything else AdamW.

Which parameters Muon takes (`muon_blocks`), as nn.Linear weights [out, in]:

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
    2. the sharder all-gathers u over the group's owner ranks (only buckets that hold Muon matrices);
    3. each rank orthogonalises (Newton-Schulz, in bf16 as torch does) the matrices, or the experts' matrices, that
       overlap the elements it owns, and applies them there: p <- p (1 - lr wd) - lr_adjusted O.

A matrix lies whole in one rank's elements unless it straddles a shard boundary: then each rank it spans computes
it (work is spread by ownership, repeated only at boundaries; an expert's matrices are batched per shape).
The momentum lives in the AdamW first-moment slot of the same elements, and the second-moment slot of Muon's
elements stays zero, so checkpoints key both rules' state alike (optimus.optim.state_ranges).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from optimus.optim.adamw import AdamW, AdamWHyper, adamw_update
from optimus.optim.memory import MUON_DIRECTION_BYTES, muon_step_bytes
from optimus.parallel.flat_buffer import FlatParams, ParamSlot, Segment

NOT_MUON = ("embed.weight", "lm_head.weight", "router.gate.weight")
EXPERT_W13, EXPERT_W2 = "experts.w13", "experts.w2"
NS_EPS = 1e-7  # torch.optim.Muon's
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic (a, b, c)


@dataclass
class MuonHyper:
    momentum: float
    nesterov: bool
    ns_steps: int
    ns_coefficients: tuple[float, float, float]
    adjust_lr: str  # original | match_rms_adamw (torch.optim.Muon's adjust_lr_fn)


def takes_muon(name: str, ndim: int) -> bool:
    """Whether Muon updates parameter `name` (AdamW does otherwise): see the module docstring."""
    return ndim >= 2 and not name.endswith(NOT_MUON)


def muon_blocks(slot_name: str, local_K: torch.Tensor) -> list[list[torch.Tensor]]:
    """The [out, in] matrices of one parameter held as `local_K` (its elements, flat, in the parameter's layout;
    any tensor of that layout), grouped per unit of work: one list per dense matrix, one per routed expert."""
    if slot_name.endswith(EXPERT_W13):
        E, D, two_f = local_K.shape
        return [[x[:, : two_f // 2].T, x[:, two_f // 2 :].T] for x in local_K]  # gate, up: [F, D] each
    if slot_name.endswith(EXPERT_W2):
        return [[x.T] for x in local_K]  # [E, F, D] -> down [D, F] per expert
    return [[local_K]]


def lr_ratio(shape: tuple[int, int], adjust: str) -> float:
    """torch.optim.Muon's learning-rate adjustment for an [A, B] matrix."""
    a, b = shape
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return math.sqrt(max(1.0, a / b))


def newton_schulz(x_BMN: torch.Tensor, steps: int, coefficients: tuple[float, float, float]) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration, in bf16, on a batch of same-shape matrices."""
    a, b, c = coefficients
    tall = x_BMN.shape[-2] > x_BMN.shape[-1]
    x = x_BMN.bfloat16()
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

    def step_bytes(self, sharder) -> tuple[int, int]:
        """(working bytes, bytes received by its gathers) of one step: the fp32 directions of the owned shard and,
        with several owners, of the gathered group (optimus.optim.memory.muon_step_bytes), the gathers counted
        over the buckets that hold a Muon matrix."""
        work = received = 0
        for group in sharder.groups.values():
            flat, world = group.flat, group.comm.shard_world
            buckets = gathered_buckets(flat, muon_slots_of(flat))
            if not buckets:
                continue
            work += muon_step_bytes(flat.numel, world, flat.buffer.element_size())[0]
            if world > 1:
                sizes = [flat.buckets[i].end - flat.buckets[i].start for i in buckets]
                received += sum(n - n // world for n in sizes) * MUON_DIRECTION_BYTES
        return work, received

    def step(self, sharder, lr: float, step: int, grad_scale: float) -> None:
        for kind, group in sharder.groups.items():
            flat = group.flat
            muon_slots = muon_slots_of(flat)
            u_shard = torch.zeros(flat.shard_numel, dtype=torch.float32, device=flat.device)
            owned_params = []
            for owned, bucket in zip(group.owned_slices(kind), flat.buckets):
                lo, hi = bucket.owned(flat.world, flat.rank)
                owned_params.append((lo, hi, owned.param))
                muon_runs, adamw_runs = split_runs(owned.segments, muon_slots, lo, hi)
                m, v = (self.state[kind][k][owned.lo : owned.lo + hi - lo] for k in self.state_kinds)
                adamw_update(adamw_runs, owned.param, owned.grad, m, v, lr, step, self.hyper, grad_scale)
                u = u_shard[owned.lo : owned.lo + hi - lo]
                for a, z in muon_runs:
                    self._momentum(owned.grad[a:z], m[a:z], u[a:z], grad_scale)
            if not muon_slots:
                continue
            u_full = group.all_gather_shard(u_shard, gathered_buckets(flat, muon_slots))  # [N_pad]; read inside them
            self._orthogonal_steps(flat, muon_slots, u_full, owned_params, lr)

    def _momentum(self, grad: torch.Tensor, m: torch.Tensor, u: torch.Tensor, grad_scale: float) -> None:
        g = grad.float() * grad_scale
        m.lerp_(g, 1 - self.muon.momentum)
        u.copy_(torch.lerp(g, m, self.muon.momentum) if self.muon.nesterov else m)

    def _orthogonal_steps(self, flat: FlatParams, slots: list[ParamSlot], u_full, owned_params, lr: float) -> None:
        """Orthogonalise each unit of work (a matrix, or one expert's matrices) that overlaps this rank's
        elements, batched by shape, write each scaled result over its direction in `u_full` (read once, by the
        stack), and apply it to the elements this rank owns."""
        owned = [(lo, hi) for lo, hi, _ in owned_params]
        pending: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
        for s in slots:
            units = muon_blocks(s.name, u_full[s.start : s.end].view(s.local.shape))
            unit_numel = s.local.numel() // len(units)
            for i, blocks in enumerate(units):
                lo, hi = s.start + i * unit_numel, s.start + (i + 1) * unit_numel
                if any(a < hi and lo < z for a, z in owned):
                    for u in blocks:
                        pending[tuple(u.shape)].append(u)
        for shape, directions in pending.items():
            o_BMN = newton_schulz(torch.stack(directions), self.muon.ns_steps, self.muon.ns_coefficients)
            ratio = lr * lr_ratio(shape, self.muon.adjust_lr)
            for u, o in zip(directions, o_BMN):
                u.copy_(o.float()).mul_(ratio)
        decay = 1 - lr * self.hyper.weight_decay  # AdamW's decoupled decay, the same key
        for s in slots:  # the owned elements of a matrix lie in units orthogonalised above
            for lo, hi, param in owned_params:
                a, z = max(lo, s.start), min(hi, s.end)
                if a < z:
                    param[a - lo : z - lo].mul_(decay).sub_(u_full[a:z])


def muon_slots_of(flat: FlatParams) -> list[ParamSlot]:
    return [s for s in flat.slots if takes_muon(s.name, s.local.dim())]


def gathered_buckets(flat: FlatParams, slots: list[ParamSlot]) -> list[int]:
    """The buckets that hold some of `slots` (Muon's matrices): the only ones whose directions are gathered."""
    return [i for i, b in enumerate(flat.buckets) if any(overlap(s, b.start, b.end) for s in slots)]


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
