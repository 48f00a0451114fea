"""Rotary position embedding (RoPE) as one differentiable operation, whose rotation a kernel backend supplies.

    out = (x1 cos - x2 sin, x2 cos + x1 sin)        x1, x2 the halves of the last dimension ("rotate_half"),
                                                     in fp32, cast once to the output dtype

The gradient of a rotation is the rotation by the opposite angle, so backward is the same computation with
-sin, and keeps only the cos and sin tables. Two rotations: `torch_rotate` (torch's ops: an fp32 output written
half by half with two fused multiply-adds each, then a cast, about 22 bytes moved per element in bf16) and the Triton
backend's (optimus.kernels.triton_backend: one kernel that reads the input in its own dtype, strided as a
transposed projection is, and writes the output in the target dtype, 4 bytes per element in bf16).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# rotate(x_BNSH, cos_SH, sin_SH, inverse, dtype) -> [B, N, S, H] contiguous in `dtype`: x (any strides) rotated by
# the tables' angles (by their opposites where `inverse`), in fp32 arithmetic.
Rotate = Callable[[Tensor, Tensor, Tensor, bool, torch.dtype], Tensor]


def torch_rotate(x_BNSH: Tensor, cos_SH: Tensor, sin_SH: Tensor, inverse: bool, dtype: torch.dtype) -> Tensor:
    """The rotation in torch's ops, written into one fp32 output: the halves never exist as separate tensors."""
    x1, x2 = x_BNSH.chunk(2, dim=-1)
    out = torch.empty(x_BNSH.shape, dtype=torch.float32, device=x_BNSH.device)
    out1, out2 = out.chunk(2, dim=-1)
    sign = -1 if inverse else 1
    torch.mul(x1, cos_SH, out=out1).addcmul_(x2, sin_SH, value=-sign)
    torch.mul(x2, cos_SH, out=out2).addcmul_(x1, sin_SH, value=sign)
    return out.to(dtype)


class _Rope(torch.autograd.Function):
    """RoPE with its backward written out: autograd of the elementwise form replays its four multiplies, the add
    and subtract, the concatenation and the casts one by one (1.5 -> 1.1 ms for a [8, 8, 256, 32] q, forward +
    backward, one EPYC core, with torch's rotation)."""

    @staticmethod
    def forward(ctx, x_BNSH: Tensor, cos_SH: Tensor, sin_SH: Tensor, dtype: torch.dtype, rotate: Rotate):
        ctx.save_for_backward(cos_SH, sin_SH)
        ctx.input_dtype, ctx.rotate = x_BNSH.dtype, rotate
        return rotate(x_BNSH, cos_SH, sin_SH, False, dtype)

    @staticmethod
    def backward(ctx, grad_BNSH: Tensor):
        cos_SH, sin_SH = ctx.saved_tensors
        return ctx.rotate(grad_BNSH, cos_SH, sin_SH, True, ctx.input_dtype), None, None, None, None


def apply_rope(
    x_BNSH: Tensor, cos_SH: Tensor, sin_SH: Tensor, dtype: torch.dtype | None = None, rotate: Rotate = torch_rotate
) -> Tensor:
    """x [B, N, S, H] rotated by the angles whose cos and sin are [S, H / 2] fp32 tables, in fp32; the result in
    `dtype` (default: the input's), contiguous, by `rotate` (a kernel backend's: see the module's docstring)."""
    return _Rope.apply(x_BNSH, cos_SH, sin_SH, dtype or x_BNSH.dtype, rotate)
