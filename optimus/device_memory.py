"""The memory a rank's device holds and has held at most: the accelerator's allocator where there is one, the
process's resident set (/proc) on a CPU; and the device's synchronisation, which timing and measuring need."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from optimus.platform import Platform

log = logging.getLogger(__name__)


def _api(platform: Platform):
    return {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None)}.get(platform.device_type)


def synchronize(platform: Platform) -> None:
    api = _api(platform)
    if api is not None:
        api.synchronize(platform.device)


def memory_allocated(platform: Platform) -> int:
    """Bytes held by tensors on the device now (0 on CPU, where torch does not track it)."""
    api = _api(platform)
    return int(api.memory_allocated(platform.device)) if api is not None else 0


def max_memory_allocated(platform: Platform) -> int:
    api = _api(platform)
    return int(api.max_memory_allocated(platform.device)) if api is not None else 0


def reset_peak_memory(platform: Platform) -> None:
    """Hand the allocator's cached blocks back and start its peak afresh (start-up checks allocate what the run never
    holds again: gigabytes at a large model's widths); a CPU's resident-set peak cannot be reset."""
    api = _api(platform)
    if api is not None:
        api.empty_cache()
        api.reset_peak_memory_stats(platform.device)


def proc_bytes(path: str, field: str) -> int | None:
    """The `field:  N kB` line of a Linux /proc file (meminfo, self/status) in bytes; None where it is absent."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):  # no /proc (not Linux), or a line of another format
        return None
    return None


_highest_resident = 0  # the largest peak_resident_bytes() has returned in this process


def peak_resident_bytes() -> int:
    """This process's peak resident set size, never less than an earlier answer.

    Linux: VmHWM, the peak of this process image alone; getrusage's ru_maxrss would also carry the
    peak of the process that forked it (a launcher, a test runner) across fork and exec. The kernel
    keeps resident counts per thread and folds them in lazily, and it records the high-water mark
    when memory is unmapped (release_free_cpu_memory), so a later VmHWM can read a few hundred kB
    below an earlier one: the running maximum keeps "the peak so far" monotone.
    """
    global _highest_resident
    peak = proc_bytes("/proc/self/status", "VmHWM")
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux kilobytes
    _highest_resident = max(_highest_resident, peak)
    return _highest_resident


def peak_memory_bytes(platform: Platform) -> int:
    """This rank's peak so far: the device allocator's on accelerators, the process's resident set on a CPU."""
    if _api(platform) is not None:
        return max_memory_allocated(platform)
    return peak_resident_bytes()
