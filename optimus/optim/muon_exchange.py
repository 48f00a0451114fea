"""Whole-matrix ownership for Muon: which rank orthogonalises each matrix, and the two all-to-alls that bring
the matrix's direction there and its update back.

A unit of work is one hidden matrix, or one routed expert's matrices (gate and up, or down; optimus.optim.muon).
Its elements lie in a group's flat buffer at [lo, hi); the buckets and the ranks' slices of them cut that range
into pieces, each held by one rank (optimus.parallel.flat_buffer). Owners are chosen unit by unit in flat
order: the rank that holds most of the unit's elements, and among ranks that hold equally many (a unit that
covers several ranks' slices whole) the one with the fewest elements owned so far, then the lowest:

    unit smaller than a slice     mostly inside one rank's slice: its holder owns it, and only the units that
                                  straddle a boundary travel (in part)
    unit larger than a slice      the ranks it covers take turns, so the Newton-Schulz work is spread over the
                                  ranks instead of landing on whichever rank a repeating layout favours

Every rank computes the same units and owners from the layout alone (the ranks of a shard group hold the same
shapes), so the exchanges need no metadata. One step:

    1. `gather`: each rank sends the pieces it holds of other ranks' units to their owners (one all_to_all);
       each owner assembles its units whole in a buffer [owned elements], in unit order
    2. the owner orthogonalises them (optimus.optim.muon)
    3. `scatter`: each owner sends every piece's update back to the rank that holds it (the reverse all_to_all)

Per bucket, a rank's slice has at most two units straddling its ends and takes part in at most two units larger
than itself, so what a rank sends, and what it receives of the units it owns, is at most two units per bucket;
an all-gather of the directions would bring every rank the whole group. With one owner (a shard world of 1)
nothing travels. `every_ranks_work` sizes every rank's part in one pass, for `optimus plan`
(optimus.optim.muon_plan).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from optimus.parallel.flat_buffer import FlatParams, ParamSlot

# (send [n], send counts per rank, receive counts per rank) -> received [m]: the shard group's all_to_all
Exchange = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


@dataclass(frozen=True)
class Piece:
    """Elements [flat_lo, flat_hi) of the flat buffer, held by `rank` at [shard_lo, ...) of its shard."""

    rank: int
    flat_lo: int
    flat_hi: int
    shard_lo: int

    @property
    def numel(self) -> int:
        return self.flat_hi - self.flat_lo


@dataclass
class Unit:
    """One unit of Newton-Schulz work: elements [lo, hi) of `slot`, the `index`-th unit of that parameter."""

    slot: ParamSlot
    index: int
    lo: int
    hi: int
    owner: int
    buf_lo: int = -1  # on its owner: where the unit sits in the buffer of owned units
    pieces: list[Piece] = field(default_factory=list)  # on its owner: every holder's; elsewhere: this rank's

    @property
    def numel(self) -> int:
        return self.hi - self.lo


EXPERT_W13, EXPERT_W2 = "experts.w13", "experts.w2"  # routed experts' tensors [E, ...]: a unit per expert


def units_of(slot: ParamSlot) -> list[tuple[int, int]]:
    """The flat ranges of `slot`'s units: one per routed expert for the experts' tensors [E, ...], else one."""
    if not slot.name.endswith((EXPERT_W13, EXPERT_W2)):
        return [(slot.start, slot.end)]
    n_experts = slot.local.shape[0]
    per_unit = (slot.end - slot.start) // max(1, n_experts)
    return [(slot.start + i * per_unit, slot.start + (i + 1) * per_unit) for i in range(n_experts)]


@dataclass(frozen=True)
class Placement:
    """Where one unit lies and who owns it: held[i] of its elements are in rank first + i's slices."""

    slot: ParamSlot
    index: int
    lo: int
    hi: int
    first: int
    held: list[int]
    owner: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def crosses(self) -> bool:
        return sum(1 for n in self.held if n) > 1


def _cuts(flat: FlatParams, starts: list[int], lo: int, hi: int):
    """Per bucket that [lo, hi) meets: (bucket, slice size, first and last element there, first and last rank);
    `starts`: the buckets' first elements."""
    for bi in range(bisect.bisect_right(starts, lo) - 1, len(flat.buckets)):
        b = flat.buckets[bi]
        if b.start >= hi:
            return
        size = (b.end - b.start) // flat.world
        a, z = max(lo, b.start), min(hi, b.end)
        yield b, size, a, z, (a - b.start) // size, (z - 1 - b.start) // size


def _held(flat: FlatParams, starts: list[int], lo: int, hi: int) -> tuple[int, list[int]]:
    """(r, held): held[i] elements of [lo, hi) are in rank r + i's slices, for the ranks from the first to the
    last that hold some. Plain ints: the plan is made under a dry run's fake tensors and on meta shapes too."""
    cuts = list(_cuts(flat, starts, lo, hi))
    r0, r1 = min(c[4] for c in cuts), max(c[5] for c in cuts)
    held = [0] * (r1 - r0 + 1)
    for b, size, a, z, first, last in cuts:
        held[first + 1 - r0 : last - r0] = [n + size for n in held[first + 1 - r0 : last - r0]]
        held[first - r0] += min(z, b.start + (first + 1) * size) - a
        if last > first:
            held[last - r0] += z - (b.start + last * size)
    return r0, held


def placements(flat: FlatParams, slots: list[ParamSlot]) -> Iterator[Placement]:
    """Every unit of `slots` in flat order with its owner (the rule in the module docstring): the same on every
    rank, from the layout alone."""
    load = [0] * flat.world  # elements owned so far, per rank
    starts = [b.start for b in flat.buckets]
    for slot in slots:
        for i, (lo, hi) in enumerate(units_of(slot)):
            first, held = _held(flat, starts, lo, hi)
            most = max(held)
            owner = min((load[first + j], first + j) for j, n in enumerate(held) if n == most)[1]
            load[owner] += hi - lo
            yield Placement(slot, i, lo, hi, first, held, owner)


@dataclass
class RankWork:
    """One rank's part of a Muon step in its shard group: the units it owns and the elements its two exchanges
    receive."""

    owned: list[Placement] = field(default_factory=list)
    received: int = 0

    @property
    def owned_numel(self) -> int:
        return sum(u.hi - u.lo for u in self.owned)


def every_ranks_work(flat: FlatParams, slots: list[ParamSlot]) -> list[RankWork]:
    """RankWork of each rank of `flat`'s shard group, in one pass over the placements (what each rank's
    MuonExchange finds). A rank receives the pieces of its units that others hold (gather) and its pieces of
    their units back (scatter); nothing travels when no unit crosses two slices."""
    work = [RankWork() for _ in range(flat.world)]
    units = list(placements(flat, slots))
    crosses = any(u.crosses for u in units)
    for u in units:
        work[u.owner].owned.append(u)
        if not crosses:
            continue
        work[u.owner].received += u.hi - u.lo - u.held[u.owner - u.first]
        for i, n in enumerate(u.held):
            if u.first + i != u.owner:
                work[u.first + i].received += n
    return work


class MuonExchange:
    """One shard group's units (of `slots`, the Muon matrices), their owners, and this rank's two exchanges."""

    def __init__(self, flat: FlatParams, slots: list[ParamSlot]):
        self.flat, self.slots, self.world, self.rank = flat, slots, flat.world, flat.rank
        self._bucket_starts = [b.start for b in flat.buckets]
        self.units: list[Unit] = []  # those this rank owns or holds a piece of, in flat order
        self.owned: list[Unit] = []
        self.crosses = False  # whether any unit spans two ranks' slices (else no exchange is needed)
        for place in placements(flat, slots):
            self.crosses = self.crosses or place.crosses
            self._add_unit(place)
        self.buf_numel = 0
        for u in self.owned:
            u.buf_lo, self.buf_numel = self.buf_numel, self.buf_numel + u.numel
        self._plan_exchanges()

    def _add_unit(self, place: Placement) -> None:
        owner = place.owner
        mine = list(self._pieces(place.lo, place.hi, None if owner == self.rank else self.rank))
        if mine:
            unit = Unit(place.slot, place.index, place.lo, place.hi, owner, pieces=mine)
            self.units.append(unit)
            if owner == self.rank:
                self.owned.append(unit)

    def _pieces(self, lo: int, hi: int, rank: int | None = None):
        """The pieces of [lo, hi), bucket by bucket and rank by rank (of `rank` alone when given)."""
        for b, size, a, z, first, last in _cuts(self.flat, self._bucket_starts, lo, hi):
            for r in range(first, last + 1) if rank is None else [rank] if first <= rank <= last else []:
                slice_lo = b.start + r * size
                p_lo, p_hi = max(a, slice_lo), min(z, slice_lo + size)
                yield Piece(r, p_lo, p_hi, b.shard_offset + p_lo - slice_lo)

    def _plan_exchanges(self) -> None:
        """Per peer rank, in unit order: what this rank sends (its pieces of their units) and receives (their
        pieces of its units); and its own pieces of its own units."""
        send, recv = defaultdict(list), defaultdict(list)  # rank -> [(shard_lo, n)] / [(buf_lo, n)]
        self.local: list[tuple[int, int, int]] = []  # (shard_lo, buf_lo, n)
        for u in self.units:
            for p in u.pieces:
                if u.owner != self.rank:
                    send[u.owner].append((p.shard_lo, p.numel))
                elif p.rank == self.rank:
                    self.local.append((p.shard_lo, u.buf_lo + p.flat_lo - u.lo, p.numel))
                else:
                    recv[p.rank].append((u.buf_lo + p.flat_lo - u.lo, p.numel))
        self.send = [run for r in range(self.world) for run in send[r]]
        self.recv = [run for r in range(self.world) for run in recv[r]]
        self.send_counts = [sum(n for _, n in send[r]) for r in range(self.world)]
        self.recv_counts = [sum(n for _, n in recv[r]) for r in range(self.world)]

    def gather(self, shard: torch.Tensor, exchange: Exchange) -> torch.Tensor:
        """[buf_numel]: this rank's owned units whole, from every holder's `shard` (a tensor laid out like the
        group's shard)."""
        buf = shard.new_empty(self.buf_numel)
        for s, b, n in self.local:
            buf[b : b + n] = shard[s : s + n]
        if self.crosses:
            move(shard, self.send, buf, self.recv, self.send_counts, self.recv_counts, exchange)
        return buf

    def scatter(self, buf: torch.Tensor, shard: torch.Tensor, exchange: Exchange) -> None:
        """The reverse of `gather`: every piece of `buf` (the owned units) written over its holder's `shard`."""
        for s, b, n in self.local:
            shard[s : s + n] = buf[b : b + n]
        if self.crosses:
            move(buf, self.recv, shard, self.send, self.recv_counts, self.send_counts, exchange)

    def received_numel(self) -> int:
        """Elements this rank receives in one step's two exchanges."""
        return (sum(self.recv_counts) + sum(self.send_counts)) if self.crosses else 0


def move(src, src_runs, dst, dst_runs, send_counts: list[int], recv_counts: list[int], exchange: Exchange) -> None:
    """One exchange: the runs [(start, n)] of `src` sent in order, what arrives written over the runs of `dst`."""
    sent = torch.cat([src[a : a + n] for a, n in src_runs]) if src_runs else src.new_empty(0)
    received = exchange(sent, send_counts, recv_counts)
    for (a, n), part in zip(dst_runs, received.split([n for _, n in dst_runs])):
        dst[a : a + n] = part
