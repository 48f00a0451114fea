"""Routed experts stored as stacked weights, run with grouped GEMMs over ragged row counts."""

from __future__ import annotations

import torch
import torch.nn as nn

from optimus.kernels import KernelBackend, get_backend


def expert_offsets(model: nn.Module) -> dict[str, int]:
    """The routed-expert parameters of `model` (names as named_parameters and state_dict give them) -> the
    global index of their first expert. The one test of what an expert parameter is: the stacked
    [E_local, ...] tensors of a GroupedExperts, which under expert parallelism hold a rank's block."""
    return {
        f"{prefix}.{name}" if prefix else name: module.expert_offset
        for prefix, module in model.named_modules()
        if isinstance(module, GroupedExperts)
        for name, _ in module.named_parameters(recurse=False)
    }


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU experts whose rows arrive sorted by expert.

    w13 holds gate and up projections side by side ([E, D, 2F]: gate = first F
    columns) so one grouped GEMM produces both. Under expert parallelism this
    module holds only the rank's slice of experts: `expert_offset` is the global
    index of its first one.
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int, kernels: str | KernelBackend = "auto"):
        super().__init__()
        self.n_experts = n_experts
        self.expert_offset = 0
        # w2 is registered first: the backward hands out w13's gradient first (its input order), and the
        # optimizer lays parameters out in reverse registration order so that gradients fill its buckets
        # front to back, each reduced as soon as it is complete (optimus.parallel.flat_buffer.flat_order).
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w13 = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden_dim))
        self.kernels = kernels if isinstance(kernels, KernelBackend) else get_backend(kernels)

    def keep_experts(self, start: int, end: int) -> None:
        """Keep only global experts [start, end) of the ones held now (copies, not views; free on meta)."""
        first, last = start - self.expert_offset, end - self.expert_offset
        if not 0 <= first < last <= self.n_experts:
            raise RuntimeError(
                f"experts [{start}, {end}) are not all held here: this module holds "
                f"[{self.expert_offset}, {self.expert_offset + self.n_experts})."
            )
        for name in ("w13", "w2"):
            param = getattr(self, name)
            setattr(self, name, nn.Parameter(param.detach()[first:last].clone(), requires_grad=param.requires_grad))
        self.n_experts = last - first
        self.expert_offset = start

    def forward(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        return self.kernels.expert_swiglu_mlp(x_AD, self.w13, self.w2, offsets_E)
