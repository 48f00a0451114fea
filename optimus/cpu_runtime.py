"""How CPU ranks share a machine: the cores each rank's threads may use, glibc's allocator kept from handing memory
back between steps, and gloo's all-to-all fallback message quieted."""

from __future__ import annotations

import logging
import os
import socket

import torch

from optimus.kernels.torch_private import DTENSOR_COLLECTIVE_LOGGER

log = logging.getLogger(__name__)


def available_cores() -> set[int]:
    """The cores this process may run on (its CPU affinity; every core where the OS has no affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def share_cpu_threads(local_world_size: int) -> int:
    """Give each of the ranks on this host an equal share of its cores (unless OMP_NUM_THREADS says otherwise).

    PyTorch starts one intra-op thread per core in every process; several ranks on
    one host would then oversubscribe the cores, and spinning OpenMP threads make a
    small matmul hundreds of times slower. Returns the thread count in effect.
    """
    if "OMP_NUM_THREADS" not in os.environ and local_world_size > 1:
        torch.set_num_threads(max(1, len(available_cores()) // local_world_size))
    return torch.get_num_threads()


def cpu_list(cores: set[int]) -> str:
    """Core numbers in Linux's cpulist form (`taskset -c`, /sys/devices/system/cpu/online): {0, 1, 2, 5} -> "0-2,5"."""
    ordered, runs = sorted(cores), []
    for core in ordered:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpu_list(text: str) -> set[int]:
    """The cores of a cpulist ("0-2,5" -> {0, 1, 2, 5})."""
    cores = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def cpu_share() -> dict:
    """This process's host, the cores it may run on (a cpulist) and its intra-op threads: run_info.json records
    them per rank, so that `optimus report` can tell a run whose ranks' threads outnumbered their cores."""
    return {"host": socket.gethostname(), "cpus": cpu_list(available_cores()), "threads": torch.get_num_threads()}


# What DTensor logs, once per process, when tensor parallelism re-shards a tensor on a CPU mesh: gloo has no
# all-to-all, so it gathers and slices instead. On a CPU that is the only way, and every rank printing it tells
# the user nothing to act on.
GLOO_ALLTOALL_FALLBACK = "CPU process group does not support alltoall yet, falling back with allgather + chunk!"


class _WithoutMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


def quiet_gloo_alltoall_fallback() -> None:
    """Drop DTensor's GLOO_ALLTOALL_FALLBACK message from its logger (every other message of it still shows)."""
    logger = logging.getLogger(DTENSOR_COLLECTIVE_LOGGER)
    if not any(isinstance(f, _WithoutMessage) for f in logger.filters):
        logger.addFilter(_WithoutMessage(GLOO_ALLTOALL_FALLBACK))


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def _glibc():
    """glibc as a ctypes library, or None (another C library, or no libc.so.6)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def keep_cpu_allocations() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the OS, in one heap.

    By default every tensor above a few MB is its own mmap, and every free returns it,
    so each training step page-faults its activations in afresh: on a 2-core CPU the
    expert path spent up to half its time in the kernel zeroing pages (benchmarks/moe_layer.py
    S2: 37% -> 84% of the dense GEMM rate). The cost is that the process keeps its peak
    footprint, as it would on a GPU with PyTorch's caching allocator. Every thread also shares
    the main heap (one arena): the collective library's and the data loader's threads would
    otherwise each grow a heap of their own, whose freed blocks no other thread can reuse (about
    30 MiB per rank of a multi-process run, benchmarks/memory.py). Returns whether it applied
    (only glibc has mallopt; elsewhere this does nothing).
    """
    libc = _glibc()
    if libc is None:
        return False
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1))
    return all([bool(libc.mallopt(param, value)) for param, value in settings])


def release_free_cpu_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim), keeping the heap's layout.

    For after a pass whose allocations the training step does not repeat (an evaluation): the
    step reuses the holes it can, and the pages of the others would otherwise stay resident
    for the whole run (keep_cpu_allocations never returns them). A page handed back costs
    one page fault when it is used again. Returns whether glibc released any memory."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))
