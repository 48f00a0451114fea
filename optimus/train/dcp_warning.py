"""torch.distributed.checkpoint without its warning that it runs in one process.

DCP's save and load (torch 2.13) warn "torch.distributed is disabled, unavailable or
uninitialized, assuming the intent is to save in a single process" at every call made
without a process group, even when `no_dist=True` says exactly that, and no argument
turns it off. Optimus does that on purpose (a single-rank run, export, import), so the
one message is silenced around those calls only: other warnings, and this one elsewhere
in the user's program, still show.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@contextmanager
def no_single_process_warning() -> Iterator[None]:
    """Run a DCP save or load without its single-process UserWarning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning)
        yield
