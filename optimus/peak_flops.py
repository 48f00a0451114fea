"""Peak FLOP/s of a device: the vendors' figures by device name, a CPU's measured by a matmul probe, or the
recipe's machine.peak_flops; MFU is measured against it."""

from __future__ import annotations

import logging
import time

import torch

from optimus.config import MachineConfig
from optimus.platform import Platform

log = logging.getLogger(__name__)


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
