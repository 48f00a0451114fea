"""Flat parameter buffers cut into buckets, each bucket split evenly over the ranks of a shard group.

One `FlatParams` holds one parameter group (dense or expert) of one rank:

    flat buffer  [N_pad]  = params laid end to end (reverse model order, so the
                            buckets fill in the order backward produces grads),
                            zero padding at the end
    buckets               = consecutive ranges of the flat buffer, each of at
                            most `bucket_numel` elements and a multiple of
                            world x align, so one reduce-scatter / all-gather
                            per bucket never exceeds the collective size limit
    rank r's shard [N_pad / world] = its 1/world slice of every bucket, in order

Parameters become views into the flat buffer, so an all-gather into a bucket
writes straight into them. Every element of the group is owned by exactly one
rank of the shard group.

A model built by optimus.train.build already keeps each group in one buffer with
this layout (allocate_flat); FlatParams then adopts that buffer instead of copying
the parameters into a new one, so a rank never holds its parameters twice (the
copy's freed originals would otherwise stay in the process's resident set, scattered
between live allocations, and count in the peak).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from optimus.kernels.torch_private import storage_id
from optimus.model.moe.experts import expert_offsets
from optimus.parallel.tensor_parallel import like_parameter, local_tensor


@dataclass
class ParamSlot:
    name: str
    param: torch.nn.Parameter  # what autograd fills (.grad) and hooks see; a DTensor under tensor parallelism
    local: torch.Tensor  # the elements this rank holds of it (the parameter itself unless a DTensor)
    start: int  # range [start, end) in the flat buffer
    end: int
    weight_decay: bool  # matrices and embeddings decay; norms and biases (1-D) do not
    global_offset: int  # index of this rank's first element in the full parameter (experts: all E experts)
    global_shape: tuple[int, ...]
    cols: tuple[int, int] | None = None  # a block of columns of the full parameter (optimus.optim.state_ranges)


@dataclass
class Bucket:
    start: int  # range [start, end) in the flat buffer; (end - start) is a multiple of world x align
    end: int
    shard_offset: int  # where this bucket's owned slice sits in the rank's shard

    def owned(self, world: int, rank: int) -> tuple[int, int]:
        size = (self.end - self.start) // world
        return self.start + rank * size, self.start + (rank + 1) * size


@dataclass
class Segment:
    """A run [lo, hi) of one bucket's owned slice with one weight-decay setting (what AdamW loops over)."""

    lo: int
    hi: int
    weight_decay: bool


@dataclass
class OwnedRange:
    """Elements [global_lo, global_hi) of parameter `name` that this rank owns, at shard [shard_lo, shard_hi)."""

    name: str
    global_lo: int
    global_hi: int
    shard_lo: int
    shard_hi: int
    global_shape: tuple[int, ...]
    cols: tuple[int, int] | None = None  # [global_lo, global_hi) index this block of columns (state_ranges)


# Where a rank's part of a parameter sits in the whole: (offset, whole shape, block of columns or None).
GlobalPlace = tuple[int, tuple[int, ...], "tuple[int, int] | None"]

ALIGN_BYTES = 128  # every rank's slice of a bucket starts on a 128-byte boundary


def same_start(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` start at the same element of the same storage: what `a.data_ptr() == b.data_ptr()`
    asks, without reading an address (a fake tensor of a dry run has none)."""
    return storage_id(a) == storage_id(b) is not None and (
        a.storage_offset() * a.element_size() == b.storage_offset() * b.element_size()
    )


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def shard_unit(world: int, element_size: int) -> int:
    """Elements in the smallest bucket: `world` slices of ALIGN_BYTES each."""
    return world * max(1, ALIGN_BYTES // element_size)


def padded_numel(numel: int, world: int, element_size: int) -> int:
    """Length of a group's flat buffer: `numel` rounded up so that `world` aligned slices tile it (0 if empty)."""
    return round_up(numel, shard_unit(world, element_size)) if numel else 0


def bucket_step(bucket_numel: int, world: int, element_size: int) -> int:
    """Elements in every bucket but the last: `bucket_numel` rounded down to whole aligned slices."""
    unit = shard_unit(world, element_size)
    return max(unit, bucket_numel // unit * unit)


def bucket_sizes(numel: int, world: int, element_size: int, bucket_numel: int) -> list[int]:
    """Elements in each bucket of a group of `numel` real elements (the buckets FlatParams cuts)."""
    padded, step = padded_numel(numel, world, element_size), bucket_step(bucket_numel, world, element_size)
    return [min(step, padded - lo) for lo in range(0, padded, step)]


def flat_order(items: list) -> list:
    """A group's parameters in flat-buffer order (reverse model order): backward fills the buckets front to back."""
    return list(reversed(items))


def param_groups(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """The trainable parameters of each data-parallel group, in model order: "dense" and "expert" (routed
    experts, which expert parallelism spreads over the EP group and data parallelism reduces over EDP)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    experts = expert_offsets(model)
    return {
        "dense": [(n, p) for n, p in named if n not in experts],
        "expert": [(n, p) for n, p in named if n in experts],
    }


def allocate_flat(params: list[torch.Tensor], world: int, device: torch.device | str) -> list[torch.Tensor]:
    """Storage for one group's parameters (`params` in model order, any device, meta included): views of one new,
    uninitialised buffer laid out as FlatParams lays out the group and padded for `world` owner ranks, returned
    in the order given. FlatParams over any shard world that divides `world` adopts the buffer without a copy
    (a smaller shard world pads less and leaves the buffer's tail, under world x 128 bytes, unused)."""
    dtype = params[0].dtype
    if any(p.dtype != dtype for p in params):
        raise ValueError("all parameters of one optimizer group must share one dtype")
    numel = sum(p.numel() for p in params)
    buffer = torch.empty(padded_numel(numel, world, params[0].element_size()), dtype=dtype, device=device)  # [N_pad]
    views, offset = {}, 0
    for i, p in flat_order(list(enumerate(params))):
        views[i] = buffer[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
    return [views[i] for i in range(len(params))]


class FlatParams:
    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        world: int,
        rank: int,
        bucket_numel: int,
        global_offsets: dict[str, GlobalPlace] | None = None,
    ):
        """`global_offsets[name]` = (first element in the full parameter, or in its block of columns; full shape;
        the block, or None), see optimus.optim.state_ranges; default: the local tensor is the whole parameter."""
        self.world, self.rank = world, rank
        params = [local_tensor(p) for _, p in named_params]
        self.dtype = params[0].dtype if params else torch.float32
        self.device = params[0].device if params else torch.device("cpu")
        if any(p.dtype != self.dtype or p.device != self.device for p in params):
            raise ValueError("all parameters of one optimizer group must share one dtype and device")
        global_offsets = global_offsets or {}
        self.slots: list[ParamSlot] = []
        offset = 0
        for (name, param), p in flat_order(list(zip(named_params, params))):
            g_off, g_shape, cols = global_offsets.get(name, (0, tuple(p.shape), None))
            slot = ParamSlot(name, param, p, offset, offset + p.numel(), p.dim() >= 2, g_off, g_shape, cols)
            self.slots.append(slot)
            offset += p.numel()
        self.numel = offset  # real elements
        es = params[0].element_size() if params else 4
        self.padded_numel = padded_numel(offset, world, es)
        self.shard_numel = self.padded_numel // world
        step = bucket_step(bucket_numel, world, es)
        self.buckets = [
            Bucket(lo, min(lo + step, self.padded_numel), lo // world) for lo in range(0, self.padded_numel, step)
        ]
        adopted = self._adopted_buffer()
        self.buffer = self._copied_buffer() if adopted is None else adopted  # [N_pad]
        with torch.no_grad():
            self.buffer[self.numel :].zero_()  # padding: zero grads, params and moments under AdamW
        self.segments = self._segments()
        self.owned_ranges = self._owned_ranges()

    def _adopted_buffer(self) -> torch.Tensor | None:
        """The buffer the parameters already live in when it has this layout (see allocate_flat), else None."""
        if not self.slots or self.device.type == "meta":
            return None
        first = self.slots[0].local
        storage, base = first.untyped_storage(), first.storage_offset()
        if storage.nbytes() < (base + self.padded_numel) * first.element_size():
            return None
        for s in self.slots:
            p = s.local
            same = storage_id(p) == storage_id(first) is not None and p.storage_offset() == base + s.start
            if not (same and p.is_contiguous()):
                return None
        return first.detach().as_strided((self.padded_numel,), (1,), base)

    @torch.no_grad()
    def _copied_buffer(self) -> torch.Tensor:
        """A new buffer holding the parameters; each original is released as soon as it is copied."""
        buffer = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)  # [N_pad]
        for s in self.slots:
            view = buffer[s.start : s.end].view_as(s.local)
            view.copy_(s.local)
            if isinstance(s.param, DTensor):  # the same DTensor object, its local slice now in the flat buffer
                torch.utils.swap_tensors(s.param, like_parameter(s.param, view))
            else:
                s.param.data = view  # the parameter now lives in the flat buffer
            s.local = view
        return buffer

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def owned_view(self, buffer: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        lo, hi = bucket.owned(self.world, self.rank)
        return buffer[lo:hi]

    def shard_view(self, shard: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        size = (bucket.end - bucket.start) // self.world
        return shard[bucket.shard_offset : bucket.shard_offset + size]

    def _owned_flat_ranges(self):
        """(flat lo, flat hi, shard lo) of each bucket's owned slice."""
        for b in self.buckets:
            lo, hi = b.owned(self.world, self.rank)
            yield lo, hi, b.shard_offset

    def _segments(self) -> list[list[Segment]]:
        """Per bucket: its owned slice (local coordinates) cut at parameter boundaries; equal-decay runs merged.

        Padding joins the run before it (its grads, params and moments stay zero under AdamW).
        """
        per_bucket = []
        for b in self.buckets:
            lo, hi = b.owned(self.world, self.rank)
            segments: list[Segment] = []
            for s in self.slots:
                a, z = max(lo, s.start), min(hi, s.end)
                if a < z:
                    self._append(segments, Segment(a - lo, z - lo, s.weight_decay))
            first_pad = max(lo, min(hi, self.numel))
            if first_pad < hi:
                decay = segments[-1].weight_decay if segments else False
                self._append(segments, Segment(first_pad - lo, hi - lo, decay))
            per_bucket.append(segments)
        return per_bucket

    @staticmethod
    def _append(segments: list[Segment], seg: Segment) -> None:
        if segments and segments[-1].hi == seg.lo and segments[-1].weight_decay == seg.weight_decay:
            segments[-1].hi = seg.hi
        else:
            segments.append(seg)

    def _owned_ranges(self) -> list[OwnedRange]:
        ranges = []
        for lo, hi, shard_lo in self._owned_flat_ranges():
            for s in self.slots:
                a, b = max(lo, s.start), min(hi, s.end)
                if a < b:
                    g = s.global_offset + a - s.start
                    ranges.append(
                        OwnedRange(s.name, g, g + b - a, shard_lo + a - lo, shard_lo + b - lo, s.global_shape, s.cols)
                    )
        return ranges
