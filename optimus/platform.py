"""Which accelerator this rank drives, which collective backend it uses, and its peak FLOP/s.

Intel GPUs appear as `xpu`; AMD GPUs under ROCm appear as `cuda` (torch.version.hip is set)
and use RCCL through the `nccl` backend name; NVIDIA GPUs are `cuda` + NCCL; CPUs use gloo.
"""

from __future__ import annotations

import importlib
import logging
import os
import platform as _pyplatform
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from optimus.config import ConfigError, MachineConfig
from optimus.fake_device import STAND_IN
from optimus.kernels.dtypes import cpu_has_fast_bf16
from optimus.kernels.torch_private import DTENSOR_COLLECTIVE_LOGGER

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Platform:
    device_type: str  # cuda | xpu | cpu, or a dry run's stand-in (optimus.fake_device.STAND_IN)
    vendor: str  # nvidia | amd | intel | cpu
    device: torch.device  # cuda:i / xpu:i / cpu, for the local rank
    backend: str  # nccl | xccl | ccl | gloo
    device_name: str
    engines: int | None = None  # the device's active vector engines, where its driver says (XPU: gpu_eu_count)

    @property
    def path(self) -> str:
        """The device path: which device's code the step takes (cpu | cuda | rocm | xpu). The one answer to
        "which device path" in Optimus; a dry run's stand-in device takes the path of the device it stands for."""
        return PATH_OF_VENDOR[self.vendor]

    @property
    def traced(self) -> bool:
        """Whether the step runs on fake tensors of a stand-in device (a dry run of a GPU's step): no kernel runs."""
        return self.device_type == STAND_IN


# The device paths, by the vendor of the device; each is a torch device type but for ROCm, whose GPUs torch calls
# `cuda` (torch.version.hip is set).
PATH_OF_VENDOR = {"cpu": "cpu", "nvidia": "cuda", "amd": "rocm", "intel": "xpu"}
DEVICE_PATHS = tuple(PATH_OF_VENDOR.values())
TORCH_DEVICE_OF_PATH = {"cpu": "cpu", "cuda": "cuda", "rocm": "cuda", "xpu": "xpu"}

# Backends each device type can run; a machine.backend override must be one of these.
_BACKENDS = {"cuda": ("nccl", "gloo"), "xpu": ("xccl", "ccl", "gloo"), "cpu": ("gloo", "mpi")}


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def declared_device_path(machine: MachineConfig) -> str:
    """The device path a machine recipe names (machine.device: cpu, cuda, rocm or xpu), or for `auto` this
    machine's: what a run there takes, and what `optimus plan` plans and traces for (which may run elsewhere, so
    nothing is checked here)."""
    want = machine.device
    if want not in ("auto", *DEVICE_PATHS):
        raise ConfigError(f"machine.device={want!r} is not supported: set it to auto, cpu, cuda, rocm or xpu.")
    if want == "auto":
        if _xpu_available():
            return "xpu"
        if torch.cuda.is_available():
            return "rocm" if torch.version.hip else "cuda"
        return "cpu"
    return want


def declared_device_type(machine: MachineConfig) -> str:
    """The torch device type of declared_device_path (cpu, cuda or xpu)."""
    return TORCH_DEVICE_OF_PATH[declared_device_path(machine)]


def _pick_device_type(machine: MachineConfig) -> str:
    """declared_device_type, which this machine must have."""
    want = declared_device_path(machine)
    if want == "xpu" and not _xpu_available():
        raise ConfigError("machine.device=xpu but torch sees no Intel GPU: set machine.device=auto or cpu.")
    if want in ("cuda", "rocm") and not torch.cuda.is_available():
        raise ConfigError(f"machine.device={want} but torch sees no CUDA/ROCm GPU: set machine.device=auto or cpu.")
    if want == "rocm" and not torch.version.hip:
        raise ConfigError("machine.device=rocm but this torch is a CUDA build: install a ROCm build or set cuda.")
    return TORCH_DEVICE_OF_PATH[want]


def _oneccl_bindings_available() -> bool:
    """Import Intel's oneCCL bindings if installed; importing them registers the `ccl` backend."""
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
    except ImportError:
        return False
    return True


def _default_backend(device_type: str) -> str:
    if device_type == "cuda":
        return "nccl"  # RCCL under ROCm answers to the same name
    if device_type == "xpu":
        return "ccl" if _oneccl_bindings_available() else "xccl"
    return "gloo"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _pyplatform.processor() or "cpu"


def detect_platform(machine: MachineConfig, local_rank: int) -> Platform:
    """Device for `local_rank` (index = local_rank mod visible devices) and its backend."""
    device_type = _pick_device_type(machine)
    if device_type == "cpu":
        device, vendor, name, engines = torch.device("cpu"), "cpu", _cpu_name(), None
    else:
        api = torch.xpu if device_type == "xpu" else torch.cuda
        # Launchers that mask devices per rank (ZE_AFFINITY_MASK, ROCR/CUDA_VISIBLE_DEVICES) leave one visible.
        index = local_rank % api.device_count()
        device, name = torch.device(device_type, index), api.get_device_name(index)
        vendor = "intel" if device_type == "xpu" else ("amd" if torch.version.hip else "nvidia")
        engines = getattr(api.get_device_properties(index), "gpu_eu_count", None) if device_type == "xpu" else None
    backend = machine.backend or _default_backend(device_type)
    if backend not in _BACKENDS[device_type]:
        raise ConfigError(
            f"machine.backend={backend!r} cannot drive a {device_type} device: "
            f"set it to one of {', '.join(_BACKENDS[device_type])} or null."
        )
    if machine.backend == "ccl" and not _oneccl_bindings_available():
        raise ConfigError(
            "machine.backend=ccl needs oneccl_bindings_for_pytorch: install it or set machine.backend=xccl."
        )
    return Platform(device_type, vendor, device, backend, name, engines)


_VENDOR_OF_PATH = {path: vendor for vendor, path in PATH_OF_VENDOR.items()}
_NAME_OF_PATH = {"cuda": "NVIDIA GPU", "rocm": "AMD GPU", "xpu": "Intel GPU"}


def stand_in_platform(path: str) -> Platform:
    """The platform of a dry run of device path `path` (cuda | rocm | xpu) on this machine: fake tensors on the
    stand-in device (optimus.fake_device), the collective backend that device's runs use."""
    from optimus.fake_device import stand_in

    backend = "xccl" if path == "xpu" else "nccl"
    return Platform(STAND_IN, _VENDOR_OF_PATH[path], stand_in(path), backend, f"{_NAME_OF_PATH[path]} (stand-in)")


# ---------------------------------------------------------------------------------------------
# Peak FLOP/s

# Dense bf16 tensor-core FLOP/s per *device as torch sees it*, from the vendors' spec sheets.
# First matching substring of the device name wins, so more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4e12),  # Grace Hopper: H100-class GPU at SXM clocks
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.5e12),  # NVIDIA H100 NVL datasheet: 1671 TFLOPS with sparsity
    ("H100", 989.4e12),  # SXM5 (reports as "NVIDIA H100 80GB HBM3")
    ("A100", 312.0e12),
    ("MI300X", 1307.4e12),
    ("MI300A", 980.6e12),
    ("MI250X", 191.5e12),  # per GCD: 383 TFLOPS per MI250X module, two GCDs, each its own device
    ("MI250", 181.0e12),  # per GCD: 362.1 TFLOPS per module
    # Intel Data Center GPU Max 1550 ("PVC"): Intel quotes 838.9 TFLOPS bf16 (XMX) per card at
    # 1.6 GHz, i.e. 128 Xe cores x 8 XMX x 512 flop/clk; a card has two tiles and Aurora exposes
    # each tile as one device (ZE_FLAT_DEVICE_HIERARCHY=FLAT), so a device is half a card.
    # (ALCF measures ~273 TFLOPS for a bf16 GEMM on one tile; MFU is against the spec peak.)
    ("Max 1550", 419.4e12),
)
# The vector engines (EUs) a figure above counts, for parts that ship with some of them off: the peak scales with
# the engines the device reports (Platform.engines). Aurora's 1550 tiles have 448 of 512 active (ALCF's machine
# overview): 419.4 x 448 / 512 = 367.0 TFLOPS per tile, recipes/machine/aurora.yaml's peak; a whole card
# (ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE) reports both tiles' engines and gets both tiles' peak.
PEAK_ENGINES = {"Max 1550": 512}

_warned_unknown: set[str] = set()


def resolve_dtype(requested: str, device_type: str, cpuinfo: str | None = None) -> str:
    """`bf16` or `fp32` for `train.dtype=requested` on a device of `device_type`.

    `auto` picks bf16 only where bf16 matmuls are fast: every accelerator (CUDA, ROCm, XPU) has bf16
    matrix units; a CPU needs AVX512-BF16 or AMX, without which PyTorch emulates bf16 matmuls tens
    of times slower than fp32.
    """
    if requested != "auto":
        return requested
    if device_type != "cpu":
        return "bf16"
    return "bf16" if cpu_has_fast_bf16(cpuinfo) else "fp32"


def lookup_peak_flops(device_name: str, engines: int | None = None) -> float | None:
    """The table's bf16 peak of a device, by name; scaled to `engines` active ones where the figure counts them."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            basis = PEAK_ENGINES.get(key)
            return flops * engines / basis if basis and engines else flops
    return None


def _time_one_mm(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - start


def cpu_matmul_probe(dtype: torch.dtype = torch.bfloat16, n: int = 512, seconds: float = 0.5) -> float:
    """Measured FLOP/s of a square matmul on this CPU, the CPU's practical peak for MFU.

    Measured on one thread and scaled by torch's thread count: a multi-threaded matmul on a
    busy machine waits for descheduled threads and can read 100x low, one thread does not.
    The size grows from 128 up to `n` while one matmul stays cheap, so a CPU without fast bf16
    (where a 1024^3 bf16 matmul takes seconds) still finishes in about `seconds`. The fastest of
    many short matmuls is the peak: at n = 512 one takes about a millisecond, shorter than a
    scheduler time slice, so on a busy machine some run undisturbed (with 1024^3, ~10 ms on an
    AVX512-BF16 core, the probe read 306 instead of 430 GFLOP/s at load 8 on 2 cores), and on an
    idle core 512^3 reaches the rate of 1024^3 (225 against 218 GFLOP/s bf16 on one EPYC core).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        size = 128
        while True:
            a = torch.randn(size, size, dtype=dtype)
            b = torch.randn(size, size, dtype=dtype)
            torch.mm(a, b)  # warm-up: kernel selection, caches
            best = min(_time_one_mm(a, b), _time_one_mm(a, b))
            if size >= n or 16 * best > seconds:
                break
            size *= 2
        spent = 0.0  # the fastest of repeated runs is the peak
        while spent < seconds / 2:
            t = _time_one_mm(a, b)
            best, spent = min(best, t), spent + t
    finally:
        torch.set_num_threads(threads)
    return 2.0 * size**3 / best * threads


_probe_cache: dict[torch.dtype, float] = {}


def peak_flops_per_device(
    platform: Platform, machine: MachineConfig, dtype: torch.dtype = torch.bfloat16
) -> tuple[float, str]:
    """(bf16 FLOP/s, source); source is config | table | cpu-probe, or unknown with 0.0 (MFU = null).

    On CPU the probe runs in `dtype` (the training dtype): many CPUs multiply bf16 far slower
    than fp32, so an fp32 run measured against a bf16 probe would exceed 100% MFU.
    """
    if machine.peak_flops:
        return float(machine.peak_flops), "config"
    if platform.device_type == "cpu":
        if dtype not in _probe_cache:
            _probe_cache[dtype] = cpu_matmul_probe(dtype)
        return _probe_cache[dtype], "cpu-probe"
    flops = lookup_peak_flops(platform.device_name, platform.engines)
    if flops is not None:
        return flops, "table"
    if platform.device_name not in _warned_unknown:
        _warned_unknown.add(platform.device_name)
        log.warning(
            "no peak FLOP/s known for %r: MFU will be reported as null; set machine.peak_flops to fix.",
            platform.device_name,
        )
    return 0.0, "unknown"


# ---------------------------------------------------------------------------------------------
# Small device helpers for the trainer


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
