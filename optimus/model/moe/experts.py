"""Routed experts stored as stacked weights, run with grouped GEMMs over ragged row counts."""

from __future__ import annotations

import torch
import torch.nn as nn

from optimus.kernels import get_backend


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU experts whose rows arrive sorted by expert.

    w13 holds gate and up projections side by side ([E, D, 2F]: gate = first F
    columns) so one grouped GEMM produces both. Under expert parallelism this
    module holds only the rank's slice of experts: `expert_offset` is the global
    index of its first one.
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int, kernels: str = "auto"):
        super().__init__()
        self.n_experts = n_experts
        self.expert_offset = 0
        self.w13 = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.kernels = get_backend(kernels)

    def forward(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        return self.kernels.expert_swiglu_mlp(x_AD, self.w13, self.w2, offsets_E)
