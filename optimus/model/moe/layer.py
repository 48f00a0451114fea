"""The MoE feed-forward layer: router -> dispatcher -> grouped experts -> combine (+ shared experts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from optimus.config import MoEConfig
from optimus.model.mlp import SwiGLU
from optimus.model.moe.dispatch import LocalDispatcher
from optimus.model.moe.experts import GroupedExperts
from optimus.model.moe.router import Router


@dataclass
class MoEStats:
    aux_loss: torch.Tensor  # scalar, differentiable
    z_loss: torch.Tensor  # scalar, differentiable
    tokens_per_expert_E: torch.Tensor  # fp32 counts, for balancing and logging


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig, kernels: str = "auto"):
        super().__init__()
        self.router = Router(dim, cfg)
        self.experts = GroupedExperts(cfg.n_experts, dim, cfg.expert_dim, kernels)
        self.shared = SwiGLU(dim, cfg.expert_dim * cfg.n_shared_experts) if cfg.n_shared_experts else None
        # Replaced from outside by an expert-parallel dispatcher (optimus.parallel).
        self.dispatcher = LocalDispatcher()

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD)
        y_TD = self.dispatcher(x_TD, routing, self.experts).to(x_BSD.dtype)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        stats = MoEStats(routing.aux_loss, routing.z_loss, routing.tokens_per_expert_E)
        return y_TD.view_as(x_BSD), stats
