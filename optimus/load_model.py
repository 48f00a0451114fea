"""Where routed tokens go when there are no values to route: the load model of a dry run.

A real step reads a few values back to the host: the rows each rank sends to and receives from every
other in the expert exchange, and the rows of each expert where a per-expert loop needs them. A dry run
(`optimus plan --dry-run`) runs the same step on fake tensors, which carry shapes but no values; there,
and only there, those reads are answered by an `ExpertLoad`: expert e receives a share p_e of the
assignments, the same on every rank. Uniform by default; with `imbalance` X the first expert (on EP rank 0,
which makes that rank the busiest) gets X times the mean share and the others split the rest equally.

The step's code calls `exchange_rows` and `expert_positions` below, and the kernels their own reads
(optimus.kernels.host_reads: the rows of each of a rank's experts, in proportion to their shares); nothing
else in it knows whether it runs for real. A dry run builds the step with `LoadAnswers(load, ep_rank)`,
which the builder hands to the dispatchers and the kernels (optimus.train.step.TrainStep's `answers`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from optimus.config import ConfigError
from optimus.host_syncs import note_read
from optimus.kernels import host_reads


@dataclass(frozen=True)
class ExpertLoad:
    """Assignment shares of `n_experts` experts: the first gets `imbalance` times the mean."""

    n_experts: int
    imbalance: float = 1.0

    def __post_init__(self):
        if self.n_experts and not 1.0 <= self.imbalance <= self.n_experts:  # (a dense model routes nothing)
            raise ConfigError(
                f"--imbalance {self.imbalance} is outside [1, {self.n_experts}]: the busiest of {self.n_experts} "
                f"experts gets between the mean share (1) and all of the assignments."
            )

    def shares(self) -> list[float]:
        first = self.imbalance / self.n_experts
        if self.n_experts == 1:
            return [1.0]
        return [first] + [(1.0 - first) / (self.n_experts - 1)] * (self.n_experts - 1)

    def split(self, n: int) -> list[int]:
        """`n` assignments over the experts in proportion to their shares, rounded so that they sum to `n`
        (largest remainders first, ties to the lower expert id)."""
        return _apportion(n, self.shares())

    def local_split(self, n: int, n_local: int, ep_rank: int) -> list[int]:
        """The `n` rows an EP rank's `n_local` experts received, over those experts in proportion to their
        shares (every source sends them in the same proportion): how a per-expert loop finds them."""
        if self.imbalance == 1.0 or ep_rank > 0 or self.n_experts % n_local:
            return host_reads.even_split(n, n_local)  # equally busy: only the first expert is busier
        local = self.shares()[:n_local]
        return _apportion(n, [share / sum(local) for share in local])

    def exchange_rows(self, assignments_C: list[int], ep_size: int, ep_rank: int) -> tuple[list, list]:
        """Per chunk, rows this rank sends to each EP rank and receives from each. Every rank of the group
        holds as many tokens as this one (the same micro-batch shape), so each source sends this rank's
        experts what this rank sends its own."""
        n_local = self.n_experts // ep_size
        send_CP, recv_CP = [], []
        for n in assignments_C:
            per_rank = [sum(block) for block in _blocks(self.split(n), n_local)]
            send_CP.append(per_rank)
            recv_CP.append([per_rank[ep_rank]] * ep_size)
        return send_CP, recv_CP


def checked_imbalance(n_experts: int, imbalance: float | None) -> float:
    """--imbalance as the command line gave it (None: left out, the uniform load 1), checked before any work: in
    [1, n_experts] (ExpertLoad), and only for a model with routed experts."""
    if imbalance is None:
        return 1.0
    if not n_experts:
        raise ConfigError(
            f"--imbalance {imbalance} sets the load of routed experts, and this model has none "
            "(model.moe.n_experts=0): leave --imbalance out."
        )
    return ExpertLoad(n_experts, imbalance).imbalance


def _apportion(n: int, shares: list[float]) -> list[int]:
    """`n` in proportion to `shares` (summing to 1), rounded so that the parts sum to `n`: largest remainders
    first, ties to the lower index."""
    exact = [n * share for share in shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _blocks(values: list[int], size: int) -> list[list[int]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


@dataclass(frozen=True)
class LoadAnswers:
    """A dry run's answers to the step's value reads, from `load`, for a rank at `ep_rank` in its EP group. The
    step's builder hands it to the EP dispatchers (`exchange_rows`, `expert_positions`) and, as `row_reads()`,
    to the kernels; a real step has none."""

    load: ExpertLoad
    ep_rank: int = 0

    def row_reads(self) -> host_reads.RowReads:
        """The kernels' share: the rows of this rank's experts (optimus.kernels.host_reads)."""
        return host_reads.RowReads(
            note_read, lambda n_rows, n_local: self.load.local_split(n_rows, n_local, self.ep_rank)
        )


def exchange_rows(
    send_PCL: torch.Tensor, recv_PCL: torch.Tensor, assignments_C: list[int], ep_rank: int,
    answers: LoadAnswers | None = None,
) -> tuple[list, list]:  # fmt: skip
    """Per chunk, the rows this rank sends to and receives from each EP rank ([C][P] lists of ints). Read
    from the exchanged counts ([P, C, L] rows per source or destination rank, chunk and local expert): the
    one host synchronisation the exchange needs, since uneven splits take host integers (a dry run's
    `answers` give them instead)."""
    if answers is not None:
        note_read()
        return answers.load.exchange_rows(assignments_C, send_PCL.shape[0], ep_rank)
    send_CP, recv_CP = torch.stack([send_PCL.sum(2).T, recv_PCL.sum(2).T]).tolist()
    return send_CP, recv_CP


def expert_positions(
    mine_M: torch.Tensor, first: int, n_local: int, answers: LoadAnswers | None = None
) -> torch.Tensor:
    """Positions of the True entries of `mine_M`, which marks the assignments (of every token of the EP group) to
    experts [first, first + n_local): torch.nonzero, whose output size is a value read back to the host (one host
    synchronisation). With a dry run's `answers`, as many positions as its load model gives those experts."""
    if answers is not None:
        note_read()
        count = sum(answers.load.split(mine_M.numel())[first : first + n_local])
        return torch.nonzero_static(mine_M, size=count).reshape(-1)
    return torch.nonzero(mine_M, as_tuple=True)[0]
