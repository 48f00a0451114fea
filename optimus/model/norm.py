"""RMSNorm whose backward keeps only its input and one fp32 number per row.

torch's `nn.RMSNorm` runs as separate ops wherever no fused kernel applies (on CPUs, and under bf16
autocast even where one exists), and autograd then keeps what each op saves: the input widened to fp32,
the normalised rows in fp32 and the product before the cast, about 12 bytes per element instead of the
input's 2. `RMSNorm` computes the same values in the same order (in fp32, the weight applied before the
cast back, as torch's composite does) with a hand-written backward that recomputes the normalised rows
from the input and the saved inverse root mean square. What a norm keeps is then the same on every
device, which is what optimus.plan counts.
"""

from __future__ import annotations

import torch
from torch import nn


class _RMSNormFunction(torch.autograd.Function):
    """y = (x / rms(x)) * w over the last dimension, in fp32, cast to x's dtype."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x_ND.float()
        rstd_N1 = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)  # fp32 [..., 1]
        ctx.save_for_backward(x_ND, weight_D, rstd_N1)
        return (x32 * rstd_N1 * weight_D).to(x_ND.dtype)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        x_ND, weight_D, rstd_N1 = ctx.saved_tensors
        normed32 = x_ND.float() * rstd_N1
        grad32 = grad_ND.float()
        grad_weight_D = (grad32 * normed32).sum(dim=tuple(range(grad32.dim() - 1))).to(weight_D.dtype)
        grad_normed32 = grad32 * weight_D.float()
        # d(x * rstd)/dx: rstd * (g - n * mean(g * n)) per row
        mean_N1 = (grad_normed32 * normed32).mean(-1, keepdim=True)
        grad_x_ND = (rstd_N1 * (grad_normed32 - normed32 * mean_N1)).to(x_ND.dtype)
        return grad_x_ND, grad_weight_D, None


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` (same parameter, attributes and values) with the lean backward above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _RMSNormFunction.apply(x, self.weight, eps)
