"""RMSNorm: `nn.RMSNorm`'s parameter and values, computed by a kernel backend's arithmetic.

The operation (fp32 inside, the weight applied before the cast back, a backward that keeps the input and one
fp32 number per row) is optimus.kernels.rms_norm's; the module holds the weight and the arithmetic of the
backend the model was built with (`kernels`), so the Triton kernels normalise wherever they run the experts.
Tensor parallelism reaches the same operation through `norm` (optimus.parallel.tensor_parallel), with the
weight's local part and, where the width is split, a sum over the ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from optimus.kernels.rms_norm import TORCH_NORM, NormArithmetic, Reduce, rms_norm


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` (same parameter, attributes and values) in `arithmetic` (default: torch's ops)."""

    def __init__(self, dim: int, eps: float | None = None, arithmetic: NormArithmetic = TORCH_NORM):
        super().__init__(dim, eps=eps)
        self.arithmetic = arithmetic

    def norm(
        self, x: torch.Tensor, weight_D: torch.Tensor, width: int | None = None, reduce: Reduce | None = None
    ) -> torch.Tensor:
        """x [..., D] normalised with `weight_D` over `width` columns, `reduce` summing over the ranks that hold the
        rest (optimus.kernels.rms_norm.rms_norm)."""
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, weight_D, eps, self.arithmetic, width, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight)
