"""All-to-all expert-parallel dispatch: each assignment's token row travels to the rank that owns its expert.

Experts are block-partitioned over the EP group (rank j owns global experts
[j * E_local, (j + 1) * E_local)), so sorting assignments by global expert also
groups them by destination rank. One step, as data on one rank:

    sort by global expert         x_AD     rows grouped by destination, then expert
    all_to_all (counts)           counts_PL  rows each source rank P sends to each local expert L
    all_to_all (rows)             x_RD     received rows, grouped by source rank, then expert
    regroup by local expert       x_GD     grouped experts need one contiguous run per expert
    grouped SwiGLU experts        y_GD
    undo regroup, all_to_all back y_AD     back on the source rank, in sorted order
    weighted combine              y_TD

Dropless; with a capacity limit the router has already dropped assignments
(routing.keep_TK), and only the kept ones are sent. Differentiable end to end:
the backward of each all-to-all is the reverse all-to-all.
"""

from __future__ import annotations

import torch

from optimus.model.moe.dispatch import run_experts, sort_by_expert
from optimus.model.moe.experts import GroupedExperts
from optimus.model.moe.router import Routing
from optimus.parallel.collectives import all_to_all, all_to_all_counts
from optimus.parallel.ep_dispatcher import EPDispatcher


def regroup_by_local_expert(counts_PL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of received rows (grouped by source rank P, then local expert L) that groups them by L, then P.

    Returns (order_R, inverse_R): rows_by_expert = rows[order_R], rows = rows_by_expert[inverse_R].
    """
    n_sources, n_local = counts_PL.shape
    expert_of_block = torch.arange(n_local, device=counts_PL.device).repeat(n_sources)  # [P * L]
    expert_R = torch.repeat_interleave(expert_of_block, counts_PL.reshape(-1))
    order_R = torch.sort(expert_R, stable=True).indices
    inverse_R = torch.empty_like(order_R)
    inverse_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    return order_R, inverse_R


class AllToAllDispatcher(EPDispatcher):
    """Expert-parallel dispatcher that exchanges token rows with all_to_all_single (uneven splits)."""

    def __call__(self, x_TD: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
        self.check_layer(experts)
        kernels = experts.kernels
        assign = sort_by_expert(routing, self.n_local * self.ep_size)
        x_AD = kernels.permute(x_TD, assign.token_idx_A)  # grouped by destination rank, then expert

        send_counts_PL = assign.counts_E.view(self.ep_size, self.n_local)
        with self.timed("dispatch_comm"):
            recv_counts_PL = all_to_all_counts(send_counts_PL, self.group)
            # One host sync: uneven splits and the grouped GEMM offsets need the counts on the CPU.
            send_rows, recv_rows = torch.stack([send_counts_PL.sum(1), recv_counts_PL.sum(1)]).tolist()
            x_RD = all_to_all(x_AD, recv_rows, send_rows, self.group)
        order_R, inverse_R = regroup_by_local_expert(recv_counts_PL)
        x_GD = kernels.permute(x_RD, order_R)
        y_GD = run_experts(experts, x_GD, recv_counts_PL.sum(0))
        y_RD = kernels.permute(y_GD, inverse_R)
        with self.timed("combine_comm"):
            y_AD = all_to_all(y_RD, send_rows, recv_rows, self.group)
        return kernels.combine(y_AD, assign.token_idx_A, assign.weight_A, x_TD.shape[0])
