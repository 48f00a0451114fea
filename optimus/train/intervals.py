"""When periodic work falls due: evaluation, the console line, checkpoints (`every N steps`)."""

from __future__ import annotations


def due_every(step: int, interval: int, last_step: int | None = None) -> bool:
    """Whether 1-based `step` ends a period of `interval` steps (interval <= 0: never), or is `last_step`.

    The last step counts too, so that a run whose length is not a multiple of the interval still
    evaluates (or saves) the model it ends with.
    """
    if interval <= 0:
        return False
    return step % interval == 0 or step == last_step
