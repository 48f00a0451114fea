"""Gradient-accumulation fusion: where a kernel may add a weight's gradient itself.

Parameters in bf16 or fp16 with gradients kept in fp32 (optim.grad_dtype=fp32) pay, per micro-batch, for the
weight gradient written in the parameter dtype and then added into the fp32 buffer by a separate kernel (the
optimizer's hook): the add reads 6 and writes 4 bytes per element. For routed experts, whose weights are large
beside the rows each micro-batch brings them, that add is a large part of the backward. A kernel whose products
accumulate in fp32 anyway can instead add its result to the fp32 buffer where it stands, as Megatron's
gradient-accumulation fusion does.

The optimizer offers a sink (`attach`) where that is safe: fp32 gradients that hooks would otherwise add up (the
full buffer of ZeRO-1, or ZeRO-2's per-parameter sums of a step's micro-batches), a plain (not tensor-parallel)
parameter of a group whose gradients need no sum over the tensor-parallel ranks first (the routed experts'). Under
zero bubble, whose weight pass (`torch.autograd.grad` towards the weights) assigns what it gets to .grad, only ZeRO-2
offers them: its hook fires in that pass and the placeholders assigned are dropped at the next event; the input pass
adds nothing, its kernels computing no weight gradient (optimus.kernels.torch_private.needed_input_grads).

A backward that uses the sink (`sink_of`, asked when the backward runs) adds its gradient into the sum there. Under
ZeRO-2 the step's first micro-batch finds no sum yet: its kernel writes its fp32 gradient as a new tensor and hands
it over as the sum (`Sink.adopt`), 4 bytes per element where zeroing a sum and adding into it moved 12 (the experts'
weight gradients are memory-bound at a few hundred rows per expert). The kernel marks the weight (`mark_added`) and
returns an uninitialised tensor in the gradient's place (no kernel computes it; autograd's engine wants a defined
gradient for a weight that requires one, as in Megatron), which the optimizer's hook drops unread (`take_added`); a
second use of the weight in the same backward returns None, so autograd adds no placeholders together. So a weight
that a sink-aware kernel takes must reach the loss through such kernels alone (the routed experts' weights do:
nothing else reads them), or autograd would add a real gradient to a placeholder that the hook drops. A kernel that
cannot fuse ignores the sink and returns the gradient, which the hook adds as before (every other parameter's). The
sink holds its owner weakly: a parameter outlives an optimizer that is gone without writing into its freed buffer.

A kernel may hold a use's product back (`defer`) to add it with the weight's next use in the same backward, in one
pass over the sum (`take_deferred`): the hook, which runs once every use of the backward has made its gradient,
adds one still held (`take_added`); a step dropped midway forgets it (`forget`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

_ATTRIBUTE = "_optimus_grad_sink"
_ADDED = "_optimus_grad_added"  # set by a kernel that added the gradient of this backward into the sink
_DEFERRED = "_optimus_grad_deferred"  # a use's product that a kernel holds back for the next use (defer)


@dataclass(frozen=True)
class _Offer:
    owner: weakref.ref  # the optimizer's group: its `sink_for(key)` is the parameter's flat fp32 sum (None: not yet)
    key: int


@dataclass(frozen=True)
class Sink:
    """Where a kernel puts one parameter's fp32 gradient: the owner's sum for it (`sum`), or, where the step has
    none yet, a new one the kernel hands over (`adopt`)."""

    owner: object  # offers sink_for(key) -> flat fp32 sum or None, and adopt_sink_sum(key, flat fp32 tensor)
    key: int
    shape: torch.Size

    def sum(self) -> torch.Tensor | None:
        """The fp32 tensor of the parameter's shape to add the gradient into; None where nothing was added this step
        (the kernel then writes its gradient as a new fp32 tensor and hands it to `adopt`)."""
        total = self.owner.sink_for(self.key)
        return None if total is None else total.view(self.shape)

    def adopt(self, grad: torch.Tensor) -> None:
        """Keep `grad` (fp32, the parameter's shape: the step's first gradient) as the sum the next ones add into."""
        self.owner.adopt_sink_sum(self.key, grad.reshape(-1))


def attach(param: torch.Tensor, owner: object | None, key: int = 0) -> None:
    """Offer `owner.sink_for(key)` (a flat fp32 tensor of `param.numel()` elements, or None where the owner has no
    sum yet and takes the first gradient as one: `owner.adopt_sink_sum(key, tensor)`) as where kernels add `param`'s
    gradient (None: offer nothing, taking back any earlier offer)."""
    if owner is None:
        if hasattr(param, _ATTRIBUTE):
            delattr(param, _ATTRIBUTE)
        return
    setattr(param, _ATTRIBUTE, _Offer(weakref.ref(owner), key))


def sink_of(param: torch.Tensor) -> Sink | None:
    """Where a kernel puts `param`'s gradient, or None where none is offered."""
    offer = getattr(param, _ATTRIBUTE, None)
    owner = offer.owner() if offer is not None else None
    return Sink(owner, offer.key, param.shape) if owner is not None else None


def mark_added(param: torch.Tensor) -> bool:
    """A kernel added a gradient of `param` into its sink in this backward: True where it is the first to (it
    returns the placeholder), False where an earlier call did (the weight used twice in a forward, as by
    parallel.ep_overlap_chunks: it returns None, so that autograd sums no placeholders)."""
    first = not getattr(param, _ADDED, False)
    setattr(param, _ADDED, True)
    return first


@dataclass(frozen=True)
class _Deferred:
    part: tuple  # what the kernel computes the product from
    add: Callable[[], None]  # adds that product alone into the sink


def defer(param: torch.Tensor, part: tuple, add: Callable[[], None]) -> None:
    """Hold back the product of one use of `param` (computed from `part`, which the weight's next use in this
    backward takes with `take_deferred`); `add()` adds it into the sink alone, as `take_added` does if none does."""
    setattr(param, _DEFERRED, _Deferred(part, add))


def _take_deferred(param: torch.Tensor) -> _Deferred | None:
    deferred = getattr(param, _DEFERRED, None)
    if deferred is not None:
        delattr(param, _DEFERRED)
    return deferred


def take_deferred(param: torch.Tensor) -> tuple | None:
    """The `part` a use of `param` held back in this backward (no longer held), or None."""
    deferred = _take_deferred(param)
    return None if deferred is None else deferred.part


def take_added(param: torch.Tensor) -> bool:
    """Whether a kernel added `param`'s gradient into its sink since the last call (the gradient autograd stored
    then holds nothing to add), after adding a product still held back (`defer`); clears the mark."""
    deferred = _take_deferred(param)
    if deferred is not None:
        deferred.add()
    added = getattr(param, _ADDED, False)
    if added:
        setattr(param, _ADDED, False)
    return added


def forget(param: torch.Tensor) -> None:
    """A new step: drop the mark and any product held back, adding nothing (a backward stopped before its hook)."""
    _take_deferred(param)
    setattr(param, _ADDED, False)
