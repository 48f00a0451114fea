"""Whole-matrix ownership for Muon: which rank orthogonalises each matrix, and the two all-to-alls that bring
the matrix's direction there and its update back.

A unit of work is one hidden matrix, or one routed expert's matrices (gate and up, or down; optimus.optim.muon).
Its elements lie in a group's flat buffer at [lo, hi); the buckets and the ranks' slices of them cut that range
into pieces, each held by one rank (optimus.parallel.flat_buffer). The unit's owner is the rank whose slice
holds its middle element:

    unit smaller than a slice     mostly inside one rank's slice: the owner holds nearly all of it, and only the
                                  units that straddle a boundary travel (in part)
    unit larger than a slice      consecutive units have their middles in different ranks' slices, so the
                                  Newton-Schulz work is spread over the ranks instead of repeated on each

Every rank computes the same units and owners from the layout alone (the ranks of a shard group hold the same
shapes), so the exchanges need no metadata. One step:

    1. `gather`: each rank sends the pieces it holds of other ranks' units to their owners (one all_to_all);
       each owner assembles its units whole in a buffer [owned elements], in unit order
    2. the owner orthogonalises them (optimus.optim.muon)
    3. `scatter`: each owner sends every piece's update back to the rank that holds it (the reverse all_to_all)

A rank receives in both rounds together at most its own elements' updates plus the pieces of the units it owns
that others hold: on average at most two fp32 shards, against the whole group's directions that an all-gather
would bring to every rank. With one owner (a shard world of 1) nothing travels.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable
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


def units_of(slot: ParamSlot) -> list[tuple[int, int]]:
    """The flat ranges of `slot`'s units: one per routed expert for the experts' tensors [E, ...], else one."""
    n_units = slot.local.shape[0] if ".experts." in slot.name else 1
    per_unit = (slot.end - slot.start) // n_units
    return [(slot.start + i * per_unit, slot.start + (i + 1) * per_unit) for i in range(n_units)]


class MuonExchange:
    """One shard group's units (of `slots`, the Muon matrices), their owners, and this rank's two exchanges."""

    def __init__(self, flat: FlatParams, slots: list[ParamSlot]):
        self.flat, self.slots, self.world, self.rank = flat, slots, flat.world, flat.rank
        self._bucket_starts = [b.start for b in flat.buckets]
        self.units: list[Unit] = []  # those this rank owns or holds a piece of, in flat order
        self.owned: list[Unit] = []
        self.crosses = False  # whether any unit spans two ranks' slices (else no exchange is needed)
        for slot in slots:
            for i, (lo, hi) in enumerate(units_of(slot)):
                self._add_unit(slot, i, lo, hi)
        self.buf_numel = 0
        for u in self.owned:
            u.buf_lo, self.buf_numel = self.buf_numel, self.buf_numel + u.numel
        self._plan_exchanges()

    def _add_unit(self, slot: ParamSlot, index: int, lo: int, hi: int) -> None:
        owner = self._rank_holding((lo + hi - 1) // 2)
        spanned = self._ranks_spanned(lo, hi)
        self.crosses = self.crosses or spanned > 1
        if owner == self.rank:
            unit = Unit(slot, index, lo, hi, owner, pieces=list(self._pieces(lo, hi)))
            self.owned.append(unit)
        else:
            mine = list(self._pieces(lo, hi, only=self.rank))
            if not mine:
                return
            unit = Unit(slot, index, lo, hi, owner, pieces=mine)
        self.units.append(unit)

    def _rank_holding(self, i: int) -> int:
        b = self.flat.buckets[bisect.bisect_right(self._bucket_starts, i) - 1]
        return (i - b.start) // ((b.end - b.start) // self.world)

    def _ranks_spanned(self, lo: int, hi: int) -> int:
        first, last = self._rank_holding(lo), self._rank_holding(hi - 1)
        same_bucket = bisect.bisect_right(self._bucket_starts, lo) == bisect.bisect_right(self._bucket_starts, hi - 1)
        return last - first + 1 if same_bucket else self.world  # across buckets: treat as spread over every rank

    def _pieces(self, lo: int, hi: int, only: int | None = None):
        """The pieces of [lo, hi), bucket by bucket and rank by rank (of rank `only` alone when given)."""
        for bi in range(bisect.bisect_right(self._bucket_starts, lo) - 1, len(self.flat.buckets)):
            b = self.flat.buckets[bi]
            if b.start >= hi:
                return
            size = (b.end - b.start) // self.world
            a, z = max(lo, b.start), min(hi, b.end)
            ranks = range((a - b.start) // size, (z - 1 - b.start) // size + 1)
            for r in ranks if only is None else [only] if only in ranks else []:
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
            sent = torch.cat([shard[s : s + n] for s, n in self.send]) if self.send else shard.new_empty(0)
            received = exchange(sent, self.send_counts, self.recv_counts)
            for (b, n), part in zip(self.recv, received.split([n for _, n in self.recv])):
                buf[b : b + n] = part
        return buf

    def scatter(self, buf: torch.Tensor, shard: torch.Tensor, exchange: Exchange) -> None:
        """The reverse of `gather`: every piece of `buf` (the owned units) written over its holder's `shard`."""
        for s, b, n in self.local:
            shard[s : s + n] = buf[b : b + n]
        if self.crosses:
            sent = torch.cat([buf[b : b + n] for b, n in self.recv]) if self.recv else buf.new_empty(0)
            received = exchange(sent, self.recv_counts, self.send_counts)
            for (s, n), part in zip(self.send, received.split([n for _, n in self.send])):
                shard[s : s + n] = part

    def received_numel(self) -> int:
        """Elements this rank receives in one step's two exchanges."""
        return (sum(self.recv_counts) + sum(self.send_counts)) if self.crosses else 0

    def work_numel(self) -> int:
        """Elements of the step's buffers beyond the direction shard: owned units, and what is sent and received."""
        return self.buf_numel + 2 * self.received_numel()
