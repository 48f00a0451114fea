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

Overlap. Each row exchange is split into a launch and a wait (collectives.all_to_all_start),
with compute in between; the backward keeps the same overlap in reverse. The shared
experts run while the first rows are in flight. With `chunks` = 2
(parallel.ep_overlap_chunks) the micro-batch's tokens are cut into two halves that go
through the steps above as a pipeline, so each half's experts run while the other
half travels:

    send half 0, send half 1, shared experts
    wait half 0, experts on half 0, send its outputs back
    wait half 1, experts on half 1, send its outputs back
    wait both, combine

Every token's assignments stay in one half, and the halves' results are the ones the
whole would give (each expert sees the same rows, in two grouped GEMMs instead of one).
The counts of every half travel in one small synchronous exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimus.load_model import exchange_rows
from optimus.model.moe.dispatch import Assignments, SharedExperts, add_shared, run_experts, sort_by_expert
from optimus.model.moe.experts import GroupedExperts
from optimus.model.moe.router import Routing
from optimus.parallel.collectives import all_to_all_counts, all_to_all_start
from optimus.parallel.ep_dispatcher import EPDispatcher


def regroup_by_local_expert(counts_PL: torch.Tensor, n_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of received rows (grouped by source rank P, then local expert L) that groups them by L, then P.

    Returns (order_R, inverse_R): rows_by_expert = rows[order_R], rows = rows_by_expert[inverse_R].
    `n_rows` (the received rows, known on the host) spares repeat_interleave reading the counts' sum back.
    """
    n_sources, n_local = counts_PL.shape
    expert_of_block = torch.arange(n_local, device=counts_PL.device).repeat(n_sources)  # [P * L]
    expert_R = torch.repeat_interleave(expert_of_block, counts_PL.reshape(-1), output_size=n_rows)
    order_R = torch.sort(expert_R, stable=True).indices
    inverse_R = torch.empty_like(order_R)
    inverse_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    return order_R, inverse_R


def token_chunks(n_tokens: int, chunks: int) -> list[slice]:
    """`chunks` contiguous slices of the tokens, sizes differing by at most one (some empty when n_tokens < chunks)."""
    bounds = [n_tokens * i // chunks for i in range(chunks + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


@dataclass
class Chunk:
    """One slice of this rank's tokens on its way through the exchange."""

    tokens: slice
    assign: Assignments  # token_idx_A counts from tokens.start
    recv_counts_PL: torch.Tensor  # rows each source rank P sends this rank's local expert L
    send_rows: list[int]  # rows to each rank
    recv_rows: list[int]  # rows from each rank


class AllToAllDispatcher(EPDispatcher):
    """Expert-parallel dispatcher that exchanges token rows with all_to_all_single (uneven splits).

    `chunks` (parallel.ep_overlap_chunks): slices of the micro-batch pipelined through the exchange.
    """

    def __init__(
        self, group, ep_size: int, ep_rank: int, n_local_experts: int, chunks: int = 1, timers=None, answers=None
    ):
        super().__init__(group, ep_size, ep_rank, n_local_experts, timers, answers)
        self.chunks = chunks  # checked by optimus.config_checks.validate (parallel.ep_overlap_chunks)

    def plan(self, routing: Routing) -> list[Chunk]:
        """Sort each chunk's assignments by expert and exchange every chunk's counts (one all_to_all)."""
        slices = token_chunks(routing.expert_idx_TK.shape[0], self.chunks)
        assigns = [sort_by_expert(routing, self.n_local * self.ep_size, tokens) for tokens in slices]
        # [P, C, L]: row j (every chunk's counts for rank j's experts) goes to rank j.
        send_PCL = torch.stack([a.counts_E.view(self.ep_size, self.n_local) for a in assigns], dim=1)
        recv_PCL = all_to_all_counts(send_PCL.reshape(self.ep_size, -1), self.group).view_as(send_PCL)
        assignments_C = [a.token_idx_A.shape[0] for a in assigns]
        send_CP, recv_CP = exchange_rows(send_PCL, recv_PCL, assignments_C, self.ep_rank, self.answers)  # 1 host sync
        return [
            Chunk(tokens, assign, recv_PCL[:, c], send_CP[c], recv_CP[c])
            for c, (tokens, assign) in enumerate(zip(slices, assigns))
        ]

    def __call__(
        self, x_TD: torch.Tensor, routing: Routing, experts: GroupedExperts, shared: SharedExperts | None = None
    ) -> torch.Tensor:
        self.check_layer(experts)
        kernels = experts.kernels
        with self.timed("dispatch_comm"):
            chunks = self.plan(routing)
        # Each chunk's rows grouped by destination rank, then expert.
        x_AD = [kernels.permute(x_TD[c.tokens], c.assign.token_idx_A) for c in chunks]
        with self.timed("dispatch_comm"):
            going = [all_to_all_start(x, c.recv_rows, c.send_rows, self.group) for x, c in zip(x_AD, chunks)]
        shared_TD = None if shared is None else shared(x_TD)  # while the rows travel
        coming = []
        for c, pending in zip(chunks, going):
            with self.timed("dispatch_comm"):
                x_RD = pending.wait()  # grouped by source rank, then expert
            y_RD = self.run_local_experts(experts, x_RD, c.recv_counts_PL)
            with self.timed("combine_comm"):
                coming.append(all_to_all_start(y_RD, c.send_rows, c.recv_rows, self.group))
        y_TD = []
        for c, pending in zip(chunks, coming):
            with self.timed("combine_comm"):
                y_AD = pending.wait()  # back in this chunk's sorted order
            y_TD.append(kernels.combine(y_AD, c.assign.token_idx_A, c.assign.weight_A, c.tokens.stop - c.tokens.start))
        return add_shared(y_TD[0] if len(y_TD) == 1 else torch.cat(y_TD), x_TD, shared_TD)

    @staticmethod
    def run_local_experts(experts: GroupedExperts, x_RD: torch.Tensor, recv_counts_PL: torch.Tensor) -> torch.Tensor:
        """Received rows (by source rank, then local expert) through the experts, outputs in the same order."""
        order_R, inverse_R = regroup_by_local_expert(recv_counts_PL, x_RD.shape[0])
        x_GD = experts.kernels.permute(x_RD, order_R)
        y_GD = run_experts(experts, x_GD, recv_counts_PL.sum(0))
        return experts.kernels.permute(y_GD, inverse_R)
