"""Token dispatch: who computes which (token, expert) assignment, and how results come back.

A dispatcher is called as `dispatcher(x_TD, routing, experts, shared=None) -> y_TD`.
The local dispatcher here runs every expert on this rank; the expert-parallel
dispatchers (all-to-all, all-gather) implement the same call and move tokens across
the EP group in between. The MoE layer does not know which one it holds. `shared`
(the layer's shared experts, applied to every token) is handed over rather than
added by the layer so that a dispatcher can compute it while tokens are in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from optimus.kernels.counting import count_ids
from optimus.model.moe.experts import GroupedExperts
from optimus.model.moe.router import Routing


@dataclass
class Assignments:
    """Kept (token, expert) assignments in expert-sorted order."""

    token_idx_A: torch.Tensor  # int64, the token each row comes from
    weight_A: torch.Tensor  # fp32 combine weight
    counts_E: torch.Tensor  # int64, rows per expert (sums to A)


def sort_by_expert(routing: Routing, n_experts: int, tokens: slice = slice(None)) -> Assignments:
    """The kept assignments of the routed `tokens` (all by default); token_idx_A counts from tokens.start."""
    expert_idx_TK = routing.expert_idx_TK[tokens]
    top_k = expert_idx_TK.shape[1]
    flat_pos_A = torch.arange(expert_idx_TK.numel(), device=expert_idx_TK.device)
    if routing.keep_TK is not None:
        flat_pos_A = flat_pos_A[routing.keep_TK[tokens].reshape(-1)]
    flat_expert_A = expert_idx_TK.reshape(-1)[flat_pos_A]
    order_A = torch.sort(flat_expert_A, stable=True).indices
    flat_pos_A = flat_pos_A[order_A]
    return Assignments(
        token_idx_A=flat_pos_A // top_k,
        weight_A=routing.weight_TK[tokens].reshape(-1)[flat_pos_A],
        counts_E=count_ids(flat_expert_A, n_experts),
    )


SharedExperts = Callable[[torch.Tensor], torch.Tensor]  # x_TD -> y_TD, applied to every token


def add_shared(
    routed_TD: torch.Tensor, x_TD: torch.Tensor, shared: SharedExperts | torch.Tensor | None
) -> torch.Tensor:
    """The layer's output: the routed experts' combine, in the residual stream's dtype, plus the shared experts'.

    `shared` is the shared experts, applied here to x_TD after the cast (the serial order, which fixes the
    order in which the backward sums x_TD's gradients), or their output, computed earlier by the caller.
    """
    routed_TD = routed_TD.to(x_TD.dtype)
    if shared is None:
        return routed_TD
    return routed_TD + (shared if isinstance(shared, torch.Tensor) else shared(x_TD))


def run_experts(experts: GroupedExperts, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Grouped experts whose output stays in the autograd graph even when no rows arrive.

    Expert-parallel backward passes run collectives, and every rank must run them: an
    empty output cut off from its input would skip them on this rank only. The expert
    weights also get a zero gradient instead of none, so gradient reductions see the
    same tensors on every rank.
    """
    y_AD = experts(x_AD, counts_E)
    if x_AD.shape[0] == 0 and torch.is_grad_enabled():
        y_AD = y_AD + x_AD + 0.0 * (experts.w13.sum() + experts.w2.sum()).to(y_AD.dtype)
    return y_AD


class Dispatcher(Protocol):
    """The call every dispatcher implements (see the module docstring)."""

    def __call__(
        self, x_TD: torch.Tensor, routing: Routing, experts: GroupedExperts, shared: SharedExperts | None = None
    ) -> torch.Tensor: ...


class LocalDispatcher:
    """All experts live on this rank: permute, grouped MLP, weighted combine."""

    def __call__(
        self, x_TD: torch.Tensor, routing: Routing, experts: GroupedExperts, shared: SharedExperts | None = None
    ) -> torch.Tensor:
        assign = sort_by_expert(routing, experts.n_experts)
        kernels = experts.kernels
        x_AD = kernels.permute(x_TD, assign.token_idx_A)
        y_AD = experts(x_AD, assign.counts_E)
        y_TD = kernels.combine(y_AD, assign.token_idx_A, assign.weight_A, x_TD.shape[0])
        return add_shared(y_TD, x_TD, shared)
