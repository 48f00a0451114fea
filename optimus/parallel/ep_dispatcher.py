"""What the expert-parallel dispatchers share: their place in the EP group, the layer check and phase timing.

A dispatcher is called as `dispatcher(x_TD, routing, experts, shared=None) -> y_TD` (optimus.model.moe.dispatch)
by the MoE layers of one rank, whose experts are this rank's block of `n_local` experts.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from optimus.model.moe.experts import GroupedExperts


class EPDispatcher:
    """Base of the all-to-all and all-gather dispatchers: EP rank `ep_rank` of `ep_size` in `group`."""

    def __init__(self, group, ep_size: int, ep_rank: int, n_local_experts: int, timers=None, answers=None):
        """`timers`: profile.timers' `name -> context manager` (optimus.train.timers.Timers), or None;
        `answers`: a dry run's optimus.load_model.LoadAnswers to the exchange's value reads, or None."""
        self.group = group
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.n_local = n_local_experts
        self.timers = timers
        self.answers = answers

    def timed(self, phase: str) -> AbstractContextManager:
        """Times `phase` (e.g. dispatch_comm) when profile.timers handed in timers; else does nothing."""
        return self.timers(phase) if self.timers else nullcontext()

    def check_layer(self, experts: GroupedExperts) -> None:
        """The layer must hold this rank's block of experts, the one the exchange sends rows to."""
        if experts.n_experts != self.n_local:
            raise ValueError(
                f"the dispatcher expects {self.n_local} local experts, the layer holds {experts.n_experts}."
            )
