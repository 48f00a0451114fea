"""What the trainer, checkpointing and tools may rely on from an optimizer (ShardedOptimizer implements it)."""

from __future__ import annotations

from typing import Protocol


class Optimizer(Protocol):
    scheme: str  # optim.sharding as resolved: none | standard | ep_aware
    update_rule: str  # optim.update: adamw | muon

    def step(self, lr: float) -> float:
        """Reduce, clip and apply this step's gradients; return the pre-clip global gradient norm."""

    def reduce_gradients(self):
        """step()'s first half: finish the reductions; this rank's share of the squared gradient norm (a 0-d fp64
        tensor on the device), to be summed over every rank by the caller."""

    def global_norm(self, sq_norm_sum: float) -> float:
        """The global norm of the mean gradient from reduce_gradients()' values summed over every rank."""

    def apply(self, lr: float, norm: float) -> None:
        """step()'s second half: clip by `norm` and update (nothing where it is not finite)."""

    def discard_gradients(self) -> None:
        """Drop this step's gradients without an update (every rank calls it for the same step)."""

    def wait_for_params(self) -> None:
        """Finish updating the parameters (step() may leave their all-gathers in flight): call it before reading
        them outside a forward."""

    def zero_grad(self) -> None:
        """Drop this step's gradients."""

    def state_tensors(self) -> list:
        """The persistent tensors it allocated besides the parameters (gradient buffers, master, its state)."""

    def state_dict(self) -> dict:
        """This rank's state, keyed by element ranges of the full parameters (views of the live tensors)."""

    def load_state_dict(self, state: dict) -> None:
        """Fill this rank's state from saved ranges of any layout that cover it."""

    def update_bytes(self) -> dict[str, int]:
        """What the update rule adds to one step on this rank (optimus.optim.memory.rank_update_bytes's keys)."""

    def memory_bytes(self) -> dict[str, int]:
        """Persistent bytes this rank holds: parameters, gradients, master weights, the rule's state, padding."""
