"""Faults a long run must survive: a stop signal from the batch system, and steps with non-finite numbers.

Both are decided together, once per step, in the all-reduce that already averages
the step's losses (`StepFlags`): every rank adds its losses, a 1 in its own slot
when its loss is not finite, and a 1 when it received a stop signal. After the
reduction every rank knows the same things, so all of them skip the same steps
and stop at the same step boundary, without an extra collective.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

import torch

# What PBS (qdel, walltime) and SLURM (--signal, preemption) send before they kill a job, and Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignal:
    """Turns SIGTERM / SIGUSR1 / SIGINT into a flag the trainer reads at step boundaries (instead of dying
    mid-step). A second Ctrl-C interrupts a process that runs alone; a rank of several gets every Ctrl-C
    twice (from the terminal and from its launcher), so there the launcher decides (see launch.spawn_local)."""

    def __init__(self):
        self.received: str | None = None  # name of the first stop signal
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; the launcher's default applies
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
        elif name == "SIGINT" == self.received and os.environ.get("WORLD_SIZE", "1") == "1":
            raise KeyboardInterrupt  # pressed again: stop now, without the checkpoint

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass
class StepFlags:
    """What the ranks agreed on in one step's reduction."""

    means: list[float]  # loss, lm_loss, aux_loss, z_loss averaged over the global batch
    nonfinite_ranks: list[int]  # ranks whose loss was not finite
    stop: bool  # some rank received a stop signal


def pack_step_flags(sums_4: torch.Tensor, rank: int, world_size: int, stop: bool) -> torch.Tensor:
    """[4 + world + 1]: this rank's loss sums, a one-hot of rank if they are not finite, the stop flag."""
    bad = (~torch.isfinite(sums_4).all()).to(sums_4.dtype)
    flags_W = torch.zeros(world_size, dtype=sums_4.dtype, device=sums_4.device)
    flags_W[rank] = bad
    stop_1 = torch.full((1,), float(stop), dtype=sums_4.dtype, device=sums_4.device)
    return torch.cat([sums_4, flags_W, stop_1])


def unpack_step_flags(reduced: torch.Tensor, n_micro_batches: int) -> StepFlags:
    """`n_micro_batches` = micro-batches over all ranks (the loss sums become global means)."""
    values = reduced.tolist()
    world = len(values) - 5
    return StepFlags(
        means=[v / n_micro_batches for v in values[:4]],
        nonfinite_ranks=[r for r in range(world) if values[4 + r] > 0],
        stop=values[-1] > 0,
    )


def discard_gradients(optimizer) -> None:
    """Drop this step's gradients on every rank alike (all ranks call it for the same step).

    The sharded optimizer's ZeRO-2 starts its reductions during the backward; they are
    finished first, so no collective is left in flight to race with the next step's.
    """
    for group in getattr(optimizer, "groups", {}).values():
        group.finish_reduction()
    optimizer.zero_grad()


class TrainingDiverged(RuntimeError):
    """More steps in a row than train.max_skipped_steps had a non-finite loss or gradient."""


def too_many_skipped_message(in_row: int, limit: int, ranks: list[int], world_size: int) -> str:
    where = (
        f"rank(s) {', '.join(map(str, ranks))} of {world_size} saw a non-finite loss"
        if ranks
        else "the gradient norm (after the reduction over all ranks) was not finite"
    )
    return (
        f"{in_row} steps in a row were skipped (more than train.max_skipped_steps={limit}): {where}; "
        "lower optim.lr, check the data, or resume from an earlier checkpoint."
    )
