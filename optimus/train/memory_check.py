"""Refuse a CPU run whose estimated memory cannot fit, before the kernel's OOM killer ends it without a word.

The estimate is the planner's (optimus.plan): persistent state per rank plus the activations
of one micro-batch, times the ranks that share this machine's memory. On accelerators the
device allocator reports its own out-of-memory errors, so only CPU runs are checked here.
"""

from __future__ import annotations

import os

from optimus.config import ConfigError
from optimus.device_memory import proc_bytes
from optimus.run_spec import RunSpec

GIB = 2**30


def available_memory_bytes() -> int | None:
    """Memory the kernel can give without swapping (MemAvailable), or None where that is unknown."""
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_cpu_memory(spec: RunSpec, local_ranks: int, available: int | None = None) -> None:
    """Raise ConfigError when `local_ranks` ranks of this run need more than the available memory."""
    from optimus.plan import plan_run

    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    plan = plan_run(spec)
    per_rank = plan.memory["total_configured"]  # with train.activation_checkpointing as set
    needed = per_rank * local_ranks
    if needed <= available:
        return
    activations = plan.activations["configured"]
    raise ConfigError(
        f"this run needs about {needed / GIB:.1f} GiB ({local_ranks} rank(s) x {per_rank / GIB:.1f} GiB, of which "
        f"{activations / GIB:.1f} GiB are activations) but only {available / GIB:.1f} GiB of memory is available: "
        "lower train.micro_batch or train.seq_len, set train.activation_checkpointing=full, "
        "or shrink the model (model.dim, model.n_layers, model.moe.*)."
    )
