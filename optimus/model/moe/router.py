"""Top-k router: picks K experts per token, gives their weights and the balancing losses.

Two scoring functions:
- softmax: probabilities over all E experts, top-k of them (optionally renormalised).
- sigmoid (DeepSeek-V3): independent sigmoid scores; a per-expert bias is added for
  the *selection only*, the weights are the unbiased scores of the chosen experts
  normalised over the K. The bias is a buffer moved by `update_bias` after each
  optimizer step (aux-loss-free balancing), never by gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from optimus.config import MoEConfig


@dataclass
class Routing:
    expert_idx_TK: torch.Tensor  # int64, chosen experts per token
    weight_TK: torch.Tensor  # fp32, combine weights (0 where an assignment was dropped)
    keep_TK: torch.Tensor | None  # bool, False where capacity dropped the assignment; None = dropless
    aux_loss: torch.Tensor  # scalar, E * sum_e f_e * P_e (1.0 when perfectly balanced)
    z_loss: torch.Tensor  # scalar, mean over tokens of logsumexp(logits)^2
    tokens_per_expert_E: torch.Tensor  # fp32, assignments chosen per expert (before capacity drops)


def capacity_keep_mask(
    expert_idx_TK: torch.Tensor, weight_TK: torch.Tensor, n_experts: int, capacity: int
) -> torch.Tensor:
    """True for the assignments each expert keeps: its `capacity` highest-weight ones.

    Ties are broken by assignment position (stable sorts), so the choice is deterministic.
    """
    flat_expert_A = expert_idx_TK.reshape(-1)
    by_weight_A = torch.sort(weight_TK.reshape(-1), descending=True, stable=True).indices
    by_expert_then_weight_A = by_weight_A[torch.sort(flat_expert_A[by_weight_A], stable=True).indices]
    counts_E = torch.bincount(flat_expert_A, minlength=n_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_expert_A = flat_expert_A[by_expert_then_weight_A]
    rank_in_expert_A = torch.arange(flat_expert_A.numel(), device=flat_expert_A.device) - starts_E[sorted_expert_A]
    keep_A = torch.empty_like(flat_expert_A, dtype=torch.bool)
    keep_A[by_expert_then_weight_A] = rank_in_expert_A < capacity
    return keep_A.view_as(expert_idx_TK)


def expert_capacity(capacity_factor: float, n_tokens: int, top_k: int, n_experts: int) -> int:
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


class Router(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.top_k
        self.score_func = cfg.router
        self.norm_topk = cfg.norm_topk
        self.capacity_factor = cfg.capacity_factor
        self.gate = nn.Linear(dim, cfg.n_experts, bias=False)
        # Selection bias for the sigmoid router; a buffer so the optimizer never touches it.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=True)

    def forward(self, x_TD: torch.Tensor) -> Routing:
        # Router math in fp32, with autocast off (it would cast the gate matmul back to bf16):
        # small logit differences decide the routing.
        with torch.autocast(x_TD.device.type, enabled=False):
            return self._route(x_TD.float())

    def _route(self, x_TD: torch.Tensor) -> Routing:
        logits_TE = F.linear(x_TD, self.gate.weight.float())
        if self.score_func == "softmax":
            probs_TE = logits_TE.softmax(dim=-1)
            score_TK, expert_idx_TK = probs_TE.topk(self.top_k, dim=-1)
            weight_TK = score_TK / score_TK.sum(dim=-1, keepdim=True) if self.norm_topk else score_TK
        else:
            scores_TE = logits_TE.sigmoid()
            _, expert_idx_TK = (scores_TE + self.expert_bias).topk(self.top_k, dim=-1)
            score_TK = scores_TE.gather(1, expert_idx_TK)
            weight_TK = score_TK / score_TK.sum(dim=-1, keepdim=True)
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)

        n_tokens = x_TD.shape[0]
        tokens_per_expert_E = torch.bincount(expert_idx_TK.reshape(-1), minlength=self.n_experts).float()
        fraction_E = tokens_per_expert_E / (n_tokens * self.top_k)
        aux_loss = self.n_experts * (fraction_E * probs_TE.mean(dim=0)).sum()
        z_loss = torch.logsumexp(logits_TE, dim=-1).square().mean()

        keep_TK = None
        if self.capacity_factor is not None:
            capacity = expert_capacity(self.capacity_factor, n_tokens, self.top_k, self.n_experts)
            # Drop the least probable assignments (raw scores, not the per-token renormalised weights).
            keep_TK = capacity_keep_mask(expert_idx_TK, score_TK.detach(), self.n_experts, capacity)
            weight_TK = weight_TK * keep_TK
        return Routing(expert_idx_TK, weight_TK, keep_TK, aux_loss, z_loss, tokens_per_expert_E)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert_E: torch.Tensor, rate: float) -> None:
        """Move the selection bias toward balance: up for under-loaded experts, down for over-loaded."""
        load_E = tokens_per_expert_E.to(self.expert_bias)
        self.expert_bias += rate * torch.sign(load_E.mean() - load_E)
