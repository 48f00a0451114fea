"""What the trainer, checkpointing and tools may rely on from an optimizer (ShardedAdamW implements it)."""

from __future__ import annotations

from typing import Protocol


class Optimizer(Protocol):
    scheme: str  # optim.sharding as resolved: none | standard | ep_aware

    def set_last_micro_batch(self, is_last: bool) -> None:
        """Called before each backward: whether it is the last one of this optimizer step."""

    def grads_assigned(self, params) -> None:
        """Called with parameters whose .grad was assigned, not accumulated by autograd (no hook fired)."""

    def step(self, lr: float) -> float:
        """Reduce, clip and apply this step's gradients; return the pre-clip global gradient norm."""

    def wait_for_params(self) -> None:
        """Finish updating the parameters (step() may leave their all-gathers in flight): call it before reading
        them outside a forward."""

    def zero_grad(self) -> None:
        """Drop this step's gradients."""

    def state_dict(self) -> dict:
        """This rank's state, keyed by element ranges of the full parameters (views of the live tensors)."""

    def load_state_dict(self, state: dict) -> None:
        """Fill this rank's state from saved ranges of any layout that cover it."""

    def memory_bytes(self) -> dict[str, int]:
        """Persistent bytes this rank holds: parameters, gradients, master weights, moments, padding."""
