"""Top-k router: picks K experts per token, gives their weights and the balancing losses.

Two scoring functions:
- softmax: probabilities over all E experts, top-k of them (optionally renormalised).
- sigmoid (DeepSeek-V3): independent sigmoid scores; a per-expert bias is added for
  the *selection only*, the weights are the unbiased scores of the chosen experts
  normalised over the K. The bias is a buffer moved by `update_bias` after each
  optimizer step (aux-loss-free balancing), never by gradients.

Group-limited routing (DeepSeek-V3, `n_groups` > 1): the experts form `n_groups`
equal groups, a group scores the sum of its two best selection scores, and each
token picks its K experts among the `topk_groups` best groups only, so that its
tokens reach few nodes when a group of experts sits on one node. The combine
weights are finally multiplied by `routed_scaling_factor`.

Load-balancing loss (one convention, OLMoE's and transformers' `load_balancing_loss_func`
for one layer): aux = E * sum_e f_e P_e, where f_e is the number of the T * K choices
that went to expert e divided by T (so sum_e f_e = K) and P_e is the mean over tokens of
expert e's probability (softmax; for sigmoid, the scores normalised per token). A
balanced router gives K; the model averages it over MoE layers, or with
`aux_loss_layers=pooled` pools f over the layers first (optimus.model.moe.stats.PooledBalance). With
`aux_loss_scope=global` the counts behind f_e are summed over the data-parallel ranks
(`balance_group`, installed from outside) before use, Qwen's global-batch balancing.
The optional sequence-wise loss (DeepSeek-V3) is computed per sequence as
sum_e (E / (K S)) count_e P_e and averaged over sequences (1 when balanced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from optimus.config import MoEConfig
from optimus.kernels.counting import count_ids


@dataclass
class Routing:
    expert_idx_TK: torch.Tensor  # int64, chosen experts per token
    weight_TK: torch.Tensor  # fp32, combine weights (0 where an assignment was dropped)
    keep_TK: torch.Tensor | None  # bool, False where capacity dropped the assignment; None = dropless
    aux_loss: torch.Tensor  # scalar, E * sum_e f_e * P_e (top_k when perfectly balanced)
    mean_prob_E: torch.Tensor  # fp32, P_e: the mean over tokens of each expert's probability
    balance_counts_E1: torch.Tensor  # fp32, the choices per expert behind f_e and, last, their tokens
    z_loss: torch.Tensor  # scalar, mean over tokens of logsumexp(logits)^2
    seq_aux_loss: torch.Tensor  # scalar, sequence-wise balance loss (0 unless seq_aux_loss_coef > 0)
    tokens_per_expert_E: torch.Tensor  # fp32, assignments chosen per expert (before capacity drops)


def expert_fractions(counts_E1: torch.Tensor) -> torch.Tensor:
    """f_e: the choices of each expert over the tokens that made them, from [choices per expert..., tokens]."""
    return counts_E1[:-1] / counts_E1[-1]


def balance_loss(fraction_E: torch.Tensor, mean_prob_E: torch.Tensor) -> torch.Tensor:
    """The load-balancing loss E * sum_e f_e P_e (top_k when balanced)."""
    return fraction_E.numel() * (fraction_E * mean_prob_E).sum()


def capacity_keep_mask(
    expert_idx_TK: torch.Tensor, weight_TK: torch.Tensor, n_experts: int, capacity: int
) -> torch.Tensor:
    """True for the assignments each expert keeps: its `capacity` highest-weight ones.

    Ties are broken by assignment position (stable sorts), so the choice is deterministic.
    """
    flat_expert_A = expert_idx_TK.reshape(-1)
    by_weight_A = torch.sort(weight_TK.reshape(-1), descending=True, stable=True).indices
    by_expert_then_weight_A = by_weight_A[torch.sort(flat_expert_A[by_weight_A], stable=True).indices]
    counts_E = count_ids(flat_expert_A, n_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_expert_A = flat_expert_A[by_expert_then_weight_A]
    rank_in_expert_A = torch.arange(flat_expert_A.numel(), device=flat_expert_A.device) - starts_E[sorted_expert_A]
    keep_A = torch.empty_like(flat_expert_A, dtype=torch.bool)
    keep_A[by_expert_then_weight_A] = rank_in_expert_A < capacity
    return keep_A.view_as(expert_idx_TK)


def limit_to_groups(choice_TE: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """Selection scores with every expert outside each token's `topk_groups` best groups set to -inf.

    A group's score is the sum of its two highest selection scores (its one score when groups have
    one expert), as DeepSeek-V3 defines it.
    """
    n_tokens, n_experts = choice_TE.shape
    grouped_TGM = choice_TE.view(n_tokens, n_groups, n_experts // n_groups)
    group_score_TG = grouped_TGM.topk(min(2, grouped_TGM.shape[-1]), dim=-1).values.sum(dim=-1)
    best_groups_TJ = group_score_TG.topk(topk_groups, dim=-1).indices
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, best_groups_TJ, True)
    return grouped_TGM.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(n_tokens, n_experts)


def sequence_balance_loss(expert_idx_TK: torch.Tensor, probs_TE: torch.Tensor, seq_len: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: per sequence sum_e (E / (K S)) count_e P_e, averaged."""
    n_tokens, n_experts = probs_TE.shape
    top_k = expert_idx_TK.shape[1]
    n_seqs = n_tokens // seq_len
    chosen_BSKE = F.one_hot(expert_idx_TK.view(n_seqs, seq_len, top_k), n_experts)
    counts_BE = chosen_BSKE.sum(dim=(1, 2)).to(probs_TE.dtype)
    fraction_BE = counts_BE * n_experts / (top_k * seq_len)
    mean_prob_BE = probs_TE.view(n_seqs, seq_len, n_experts).mean(dim=1)
    return (fraction_BE * mean_prob_BE).sum(dim=-1).mean()


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
        self.n_groups = cfg.n_groups
        self.topk_groups = cfg.topk_groups
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.aux_loss_scope = cfg.aux_loss_scope
        self.with_seq_aux_loss = cfg.seq_aux_loss_coef > 0
        # Process group over which the expert counts are summed; set by the code that lays the model out
        # (optimus.parallel): the data-parallel ranks for aux_loss_scope=global, the tensor-parallel ranks
        # (which route parts of one micro-batch) for micro_batch. None = the tokens routed here only.
        self.balance_group = None
        self.gate = nn.Linear(dim, cfg.n_experts, bias=False)
        # Selection bias for the sigmoid router; a buffer so the optimizer never touches it.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=True)

    def forward(self, x_TD: torch.Tensor, seq_len: int | None = None) -> Routing:
        """Route the T tokens of `x_TD`; `seq_len` splits them into sequences for the sequence-wise loss."""
        # Router math in fp32, with autocast off (it would cast the gate matmul back to bf16):
        # small logit differences decide the routing.
        with torch.autocast(x_TD.device.type, enabled=False):
            return self._route(x_TD.float(), seq_len or x_TD.shape[0])

    def _route(self, x_TD: torch.Tensor, seq_len: int) -> Routing:
        logits_TE = F.linear(x_TD, self.gate.weight.float())
        if self.score_func == "softmax":
            scores_TE = probs_TE = logits_TE.softmax(dim=-1)
            choice_TE = scores_TE
        else:
            scores_TE = logits_TE.sigmoid()
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
            choice_TE = scores_TE + self.expert_bias
        if self.n_groups > 1:
            choice_TE = limit_to_groups(choice_TE, self.n_groups, self.topk_groups)
        expert_idx_TK = choice_TE.topk(self.top_k, dim=-1).indices
        score_TK = scores_TE.gather(1, expert_idx_TK)
        renormalise = self.norm_topk or self.score_func == "sigmoid"
        weight_TK = score_TK / score_TK.sum(dim=-1, keepdim=True) if renormalise else score_TK
        if self.routed_scaling_factor != 1.0:
            weight_TK = weight_TK * self.routed_scaling_factor

        n_tokens = x_TD.shape[0]
        tokens_per_expert_E = count_ids(expert_idx_TK, self.n_experts).float()
        balance_counts_E1 = self._balance_counts(tokens_per_expert_E, n_tokens)
        mean_prob_E = probs_TE.mean(dim=0)
        aux_loss = balance_loss(expert_fractions(balance_counts_E1), mean_prob_E)
        seq_aux_loss = aux_loss.new_zeros(())
        if self.with_seq_aux_loss:
            seq_aux_loss = sequence_balance_loss(expert_idx_TK, probs_TE, seq_len)
        z_loss = torch.logsumexp(logits_TE, dim=-1).square().mean()

        keep_TK = None
        if self.capacity_factor is not None:
            capacity = expert_capacity(self.capacity_factor, n_tokens, self.top_k, self.n_experts)
            # Drop the least probable assignments (raw scores, not the per-token renormalised weights).
            keep_TK = capacity_keep_mask(expert_idx_TK, score_TK.detach(), self.n_experts, capacity)
            weight_TK = weight_TK * keep_TK
        return Routing(
            expert_idx_TK, weight_TK, keep_TK, aux_loss, mean_prob_E, balance_counts_E1, z_loss, seq_aux_loss,
            tokens_per_expert_E,
        )  # fmt: skip

    def _balance_counts(self, tokens_per_expert_E: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """[choices per expert..., tokens], summed over `balance_group`: what f_e divides."""
        # new_full, not new_tensor: a tensor made from host data is a blocking copy on a GPU, which waits for the
        # whole queue (once per MoE layer and micro-batch, seen in an H200's profile)
        counts_E1 = torch.cat([tokens_per_expert_E, tokens_per_expert_E.new_full((1,), n_tokens)])
        # Only training steps count over a group: evaluation may run on some ranks only and needs no loss.
        if self.balance_group is not None and self.training:
            dist.all_reduce(counts_E1, group=self.balance_group)  # counts carry no gradient
        return counts_E1

    @torch.no_grad()
    def update_bias(self, tokens_per_expert_E: torch.Tensor, rate: float) -> None:
        """Move the selection bias toward balance: up for under-loaded experts, down for over-loaded."""
        load_E = tokens_per_expert_E.to(self.expert_bias)
        self.expert_bias += rate * torch.sign(load_E.mean() - load_E)
