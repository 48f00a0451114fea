"""RMSNorm over the last dimension as one differentiable operation, whose arithmetic a kernel backend supplies.

    y = x * rsqrt(sum(x^2) / width + eps) * w        in fp32, cast to x's dtype

The weight is applied before the cast, as torch's composite `nn.RMSNorm` does. `width` is the whole normalised
width, of which x may hold only part: tensor parallelism splits a full-projection QK-norm's width over its ranks,
and `reduce` (a callable that sums a per-row fp32 tensor over those ranks, in place, and returns it) completes
the two per-row sums the operation needs, sum(x^2) in forward and sum(g * w * x) in backward.

Backward keeps only the input and one fp32 number per row (the inverse root mean square), and recomputes the
normalised rows from them: torch's `nn.RMSNorm`, where no fused kernel applies (on CPUs, and under bf16 autocast
even where one exists), runs as separate ops whose autograd keeps the input widened to fp32, the normalised rows
and the product before the cast, about 12 bytes per element instead of the input's 2. What a norm keeps is then
the same on every device and backend, which is what optimus.plan counts.

Two arithmetics: `TORCH_NORM` (torch's ops: fp32 temporaries, several passes over the rows each way) and the
Triton backend's kernels (optimus.kernels.triton_backend: one kernel each way over a tile of rows, reading the
input in its own dtype and writing the output in it; a first walk along the rows sums, a second writes, rereading
the tile from the cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from optimus.kernels.torch_private import needed_input_grads

Reduce = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class NormArithmetic:
    """The three computations `rms_norm` is made of, on contiguous [N, D] rows (D: this rank's part of the width).

    row_dot(a_ND, b_ND, w_D | None) -> [N] fp32: sum over the columns of a * b (* w).
    forward(x_ND, w_D, eps, width, sumsq_N | None) -> (y_ND in x's dtype, rstd_N fp32); sumsq_N: the rows' sums
        of squares over the whole width (None: x holds all of it).
    backward(g_ND, x_ND, w_D, rstd_N, width, dot_N | None) -> (dx_ND in x's dtype, dw_D in w's dtype); dot_N: the
        rows' sums of g * w * x over the whole width (None: x holds all of it).
    """

    name: str
    row_dot: Callable
    forward: Callable
    backward: Callable


def _torch_row_dot(a_ND: Tensor, b_ND: Tensor, w_D: Tensor | None) -> Tensor:
    prod_ND = a_ND.float() * b_ND.float()
    return (prod_ND * w_D.float() if w_D is not None else prod_ND).sum(-1)


def _torch_forward(x_ND: Tensor, w_D: Tensor, eps: float, width: int, sumsq_N: Tensor | None):
    x32 = x_ND.float()
    mean_sq_N = x32.square().mean(-1) if sumsq_N is None else sumsq_N / width
    rstd_N = torch.rsqrt(mean_sq_N + eps)
    return (x32 * rstd_N[:, None] * w_D).to(x_ND.dtype), rstd_N


def _torch_backward(g_ND: Tensor, x_ND: Tensor, w_D: Tensor, rstd_N: Tensor, width: int, dot_N: Tensor | None):
    normed32 = x_ND.float() * rstd_N[:, None]
    grad32 = g_ND.float()
    grad_w_D = (grad32 * normed32).sum(0).to(w_D.dtype)
    grad_normed32 = grad32 * w_D.float()
    # d(x * rstd)/dx: rstd * (g - n * mean(g * n)) per row, the mean over the whole width
    if dot_N is None:
        mean_N1 = (grad_normed32 * normed32).mean(-1, keepdim=True)
    else:
        mean_N1 = (dot_N * rstd_N / width)[:, None]
    grad_x_ND = (rstd_N[:, None] * (grad_normed32 - normed32 * mean_N1)).to(x_ND.dtype)
    return grad_x_ND, grad_w_D


TORCH_NORM = NormArithmetic("torch", _torch_row_dot, _torch_forward, _torch_backward)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight_D: Tensor, eps: float, width: int, reduce: Reduce | None, ops: NormArithmetic):
        x_ND = x.reshape(-1, x.shape[-1]).contiguous()  # [N, D]: a view where x is contiguous
        sumsq_N = reduce(ops.row_dot(x_ND, x_ND, None)) if reduce is not None else None
        y_ND, rstd_N = ops.forward(x_ND, weight_D, eps, width, sumsq_N)
        ctx.save_for_backward(x_ND, weight_D, rstd_N)
        ctx.width, ctx.reduce, ctx.ops = width, reduce, ops
        return y_ND.view(x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        needs_x, needs_w = needed_input_grads(ctx)[:2]
        pending_w_D = ctx.__dict__.pop("pending_grad_w_D", None)
        if pending_w_D is not None and not needs_x:  # zero bubble's weight pass: what its input pass computed
            return None, pending_w_D, None, None, None, None  # (and no collective)
        x_ND, weight_D, rstd_N = ctx.saved_tensors
        g_ND = grad.reshape(x_ND.shape).contiguous()
        dot_N = ctx.reduce(ctx.ops.row_dot(g_ND, x_ND, weight_D)) if ctx.reduce is not None else None
        grad_x_ND, grad_w_D = ctx.ops.backward(g_ND, x_ND, weight_D, rstd_N, ctx.width, dot_N)
        if not needs_w and ctx.needs_input_grad[1]:
            # Zero bubble's input pass: one kernel made both gradients (the weight's from the same reads, where a
            # weight pass of its own would read the activations again); the weight pass takes it from here.
            ctx.pending_grad_w_D, grad_w_D = grad_w_D, None
        return grad_x_ND.view(grad.shape), grad_w_D, None, None, None, None


def rms_norm(
    x: Tensor,
    weight_D: Tensor,
    eps: float,
    ops: NormArithmetic = TORCH_NORM,
    width: int | None = None,
    reduce: Reduce | None = None,
) -> Tensor:
    """RMSNorm of x [..., D] with weight [D] over a width of `width` columns (None: D, x's own), in `ops`'
    arithmetic; `reduce` sums a per-row fp32 tensor over the ranks that hold the rest of the width (None: no
    other rank does). -> [..., D] in x's dtype."""
    width = x.shape[-1] if width is None else width
    if reduce is None and width != x.shape[-1]:
        raise ValueError(f"a norm over {width} columns of which x holds {x.shape[-1]} needs a `reduce` over the rest")
    return _RMSNorm.apply(x, weight_D, eps, width, reduce, ops)
