"""All-gather expert-parallel dispatch: every rank sees every token, computes its own experts, reduce-scatters.

The scheme used on Aurora, where the all-gather and reduce-scatter collectives are
better tuned than all-to-all with uneven splits. One step, as data on one rank
(P = EP group size, the same T on every rank):

    all_gather tokens and routing     x_ND, expert_idx_NK, weight_NK   with N = P * T
    keep assignments to local experts, sorted by expert
    grouped SwiGLU experts            y_AD
    weighted combine into N rows      partial_ND   (this rank's experts' share of every token)
    reduce_scatter (sum)              y_TD         the rows of this rank's own tokens

Sends (P - 1) * T rows each way per rank whatever the routing, so it suits small
EP groups and balanced fast links. Differentiable: all-gather and reduce-scatter
are each other's backward, and the routing weights are gathered with gradient.
"""

from __future__ import annotations

import torch

from optimus.config import ConfigError
from optimus.kernels.counting import count_ids
from optimus.kernels.dtypes import compute_dtype
from optimus.load_model import expert_positions
from optimus.model.moe.dispatch import SharedExperts, add_shared, run_experts
from optimus.model.moe.experts import GroupedExperts
from optimus.model.moe.router import Routing
from optimus.parallel.collectives import all_gather, all_gather_sizes, reduce_scatter
from optimus.parallel.ep_dispatcher import EPDispatcher


def local_assignments(expert_idx_NK: torch.Tensor, first: int, n_local: int, answers=None):
    """Flat positions (into N * K) of the assignments to experts [first, first + n_local), sorted by expert.

    Dropped assignments carry expert id -1 and are never selected. Returns (flat_pos_A, local_expert_A, counts_L).
    `answers`: a dry run's (optimus.load_model.expert_positions).
    """
    local_NK = expert_idx_NK - first
    mine_NK = (local_NK >= 0) & (local_NK < n_local)
    flat_pos_A = expert_positions(mine_NK.reshape(-1), first, n_local, answers)
    local_A = local_NK.reshape(-1)[flat_pos_A]
    order_A = torch.sort(local_A, stable=True).indices
    counts_L = count_ids(local_A, n_local)
    return flat_pos_A[order_A], local_A[order_A], counts_L


class AllGatherDispatcher(EPDispatcher):
    """Expert-parallel dispatcher built on all_gather_into_tensor and reduce_scatter_tensor.

    `check_tokens`: check on every call that the EP ranks bring equal token counts (off where the caller
    guarantees it: optimus.parallel.expert_parallel.apply_expert_parallel's `equal_tokens`)."""

    def __init__(
        self, group, ep_size: int, ep_rank: int, n_local_experts: int, check_tokens: bool = True, timers=None,
        answers=None,
    ):  # fmt: skip
        super().__init__(group, ep_size, ep_rank, n_local_experts, timers, answers)
        self.check_tokens = check_tokens

    def _check_equal_tokens(self, n_tokens: int, device: torch.device) -> None:
        """Every EP rank must bring the same number of tokens (the all-gathers below assume it). Checked on every
        call: a rank-local cache of the last agreed count would let one rank skip the check while a peer with a
        new count issues it, pairing that check with the peer's data all-gather (a hang where this refuses)."""
        sizes = all_gather_sizes(n_tokens, device, self.group)
        if len(set(sizes)) != 1:
            raise ConfigError(
                f"parallel.dispatcher=allgather needs the same number of tokens on every EP rank, got {sizes}: "
                "use the same train.micro_batch and train.seq_len everywhere, or parallel.dispatcher=alltoall."
            )

    def __call__(
        self, x_TD: torch.Tensor, routing: Routing, experts: GroupedExperts, shared: SharedExperts | None = None
    ) -> torch.Tensor:
        self.check_layer(experts)
        x_in_TD = x_TD
        n_tokens, top_k = routing.expert_idx_TK.shape
        if self.check_tokens:
            with self.timed("dispatch_comm"):
                self._check_equal_tokens(n_tokens, x_TD.device)
        keep_TK = (
            routing.keep_TK if routing.keep_TK is not None else torch.ones_like(routing.expert_idx_TK, dtype=torch.bool)
        )
        # Expert id and keep flag travel in one integer tensor: -1 marks a dropped assignment.
        packed_TK = torch.where(keep_TK, routing.expert_idx_TK, -1)
        # Under autocast the experts take their rows in the autocast dtype: gather them in it (half
        # the bytes of the fp32 residual stream, and the same values the experts would round to).
        x_TD = x_TD.to(compute_dtype(x_TD))
        with self.timed("dispatch_comm"):
            packed_NK = all_gather(packed_TK, self.group)
            weight_NK = all_gather(routing.weight_TK, self.group)  # fp32: the combine weights stay exact
            x_ND = all_gather(x_TD, self.group)

        first = self.ep_rank * self.n_local
        flat_pos_A, _, counts_L = local_assignments(packed_NK, first, self.n_local, self.answers)
        token_idx_A = flat_pos_A // top_k
        kernels = experts.kernels
        x_AD = kernels.permute(x_ND, token_idx_A)
        y_AD = run_experts(experts, x_AD, counts_L)
        partial_ND = kernels.combine(y_AD, token_idx_A, weight_NK.reshape(-1)[flat_pos_A], x_ND.shape[0])
        with self.timed("combine_comm"):
            y_TD = reduce_scatter(partial_ND, self.group)
        # The collectives here are synchronous: nothing to overlap the shared experts with.
        return add_shared(y_TD, x_in_TD, shared)
