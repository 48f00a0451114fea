"""The rates the performance model assumes (optimus.perf.costs), measured on this rank's device: a matrix
product at the step's shape, the memory bandwidth, the kernel floor.

Accelerators are timed with their device events, a CPU by the host clock; each figure is the median of
repeated runs after a warm-up. On a CPU the bandwidth and the time per operator are those that `machine=local`
measures (optimus.perf.machine.measure_cpu: the median of a basket of elementwise kernels at the largest size,
and a tiny add), so that both ways of describing a CPU agree.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from optimus.config import TORCH_DTYPES, MachineConfig, ModelConfig
from optimus.device_memory import proc_bytes
from optimus.model import moe_layer_ids
from optimus.peak_flops import peak_flops_per_device
from optimus.platform import Platform

GPU_REPS = 20
CPU_REPS = 10
CPU_BUDGET_S = 2.0  # a CPU stops repeating a measurement after this long (a large product takes seconds)
COPY_BYTES = 2**30  # the bandwidth's copy: 1 GiB read and 1 GiB written, well beyond any cache
FLOOR_BURST = 100  # tiny kernels issued back to back per timed run


def median_seconds(
    fn: Callable[[], object], device: torch.device, reps: int, before: Callable[[], object] | None = None
) -> float:
    """The median seconds of `fn()` on `device` over `reps` runs after two warm-up runs: device events on an
    accelerator (the device's own time, not the host's launch time), the host clock on a CPU (where a run
    stops early once CPU_BUDGET_S is spent and three are done). `before` runs before each timed run, untimed
    (a barrier, so that every rank starts a collective together)."""
    for _ in range(2):
        fn()
    if device.type == "cpu":
        times, spent = [], 0.0
        while len(times) < reps and (len(times) < 3 or spent < CPU_BUDGET_S):
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            spent += times[-1]
        return statistics.median(times)
    api = torch.get_device_module(device.type)
    api.synchronize(device)
    events = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = api.Event(enable_timing=True), api.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    api.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3  # elapsed_time: ms


def free_bytes(device: torch.device) -> int | None:
    """Memory free on `device` now: the device's own on an accelerator, the host's available memory on a CPU;
    None where it cannot be read."""
    if device.type == "cpu":
        return proc_bytes("/proc/meminfo", "MemAvailable")
    api = torch.get_device_module(device.type)
    try:
        return int(api.mem_get_info(device)[0])
    except (AttributeError, RuntimeError, NotImplementedError):  # XPU without Level Zero's sysman cannot say
        return int(api.get_device_properties(device).total_memory - api.memory_reserved(device))


def gemm_shape(model: ModelConfig, tokens: int) -> tuple[int, int, int]:
    """(M, K, N) of the step's typical product: a micro-batch's tokens [M, dim] times a feed-forward weight
    [dim, N], N the dense FFN's width (ffn_dim), or for an MoE model an expert's three matrices side by side
    (3 x expert_dim)."""
    width = 3 * model.moe.expert_dim if moe_layer_ids(model) else model.ffn_dim
    return tokens, model.dim, width


def peak_flops(platform: Platform, machine: MachineConfig, dtype: torch.dtype) -> tuple[float, str]:
    """(matrix FLOP/s of `dtype` per device, its source): the peak gemm_efficiency is a fraction of. bf16 and a
    CPU's fp32 as MFU takes them (optimus.peak_flops.peak_flops_per_device); fp32 on an accelerator as the
    performance model takes it (optimus.perf.machine.machine_model: machine.perf.peak_flops_fp32, else a
    quarter of the bf16 peak)."""
    if dtype == torch.float32 and platform.device_type != "cpu":
        if machine.perf.peak_flops_fp32:
            return float(machine.perf.peak_flops_fp32), "config"
        bf16, source = peak_flops_per_device(platform, machine, torch.bfloat16)
        return bf16 / 4, f"{source}, a quarter of the bf16 peak"
    return peak_flops_per_device(platform, machine, dtype)


def measure_gemm(platform: Platform, machine: MachineConfig, shape: tuple[int, int, int], dtype: torch.dtype) -> dict:
    """FLOP/s of `torch.mm` at `shape` in `dtype`, and that as a fraction of the device's peak."""
    m, k, n = shape
    device = platform.device
    a_MK = torch.randn(m, k, device=device, dtype=dtype)
    b_KN = torch.randn(k, n, device=device, dtype=dtype)
    reps = CPU_REPS if device.type == "cpu" else GPU_REPS
    rate = 2 * m * k * n / median_seconds(lambda: torch.mm(a_MK, b_KN), device, reps)
    peak, source = peak_flops(platform, machine, dtype)
    return {
        "shape": [m, k, n],
        "dtype": next(name for name, torch_dtype in TORCH_DTYPES.items() if torch_dtype == dtype),
        "flops_per_s": rate,
        "peak_flops": peak or None,
        "peak_source": source,
        "fraction_of_peak": rate / peak if peak else None,
    }


def measure_memory_and_floor(device: torch.device) -> tuple[dict, dict]:
    """({bytes_per_s, how}, {seconds, how}): the memory bandwidth of a large copy (bytes read + written) and the
    time of a tiny kernel in a stream of them (launch and start-up)."""
    if device.type == "cpu":
        from optimus.perf.machine import measure_cpu

        cpu = measure_cpu(torch.get_num_threads())
        moved, bandwidth = cpu["by_size"][-1]
        basket = f"median of machine=local's elementwise kernels moving {moved / 2**20:.0f} MiB (measure_cpu)"
        return (
            {"bytes_per_s": bandwidth, "how": basket},
            {"seconds": cpu["host_op"], "how": "a tiny add, as machine=local's host time per operator"},
        )
    free = free_bytes(device)
    copy_bytes = min(COPY_BYTES, free // 8) if free else COPY_BYTES  # source and destination: a quarter of free
    return (
        {"bytes_per_s": _copy_rate(device, copy_bytes), "how": f"a {copy_bytes / 2**20:.0f} MiB copy, read + written"},
        {"seconds": _kernel_floor(device), "how": f"a 1-element add, {FLOOR_BURST} back to back"},
    )


def _copy_rate(device: torch.device, copy_bytes: int) -> float:
    """Bytes/s read and written by a copy of `copy_bytes` on the device."""
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * copy_bytes / median_seconds(lambda: dst.copy_(src), device, GPU_REPS)


def _kernel_floor(device: torch.device) -> float:
    """Seconds per kernel of a stream of 1-element adds: launch and start-up, which no kernel beats."""
    one = torch.zeros(1, device=device)

    def burst():
        for _ in range(FLOOR_BURST):
            one.add_(1)

    return median_seconds(burst, device, GPU_REPS) / FLOOR_BURST


def measure_rates(platform: Platform, machine: MachineConfig, model: ModelConfig, tokens: int, dtype) -> dict:
    """Every rate of this module on this rank's device."""
    gemm = measure_gemm(platform, machine, gemm_shape(model, tokens), dtype)
    bandwidth, floor = measure_memory_and_floor(platform.device)
    rates = {"gemm": gemm, "memory_bandwidth": bandwidth, "kernel_floor": floor}
    if platform.device_type == "cpu" and dtype != torch.bfloat16:  # the model's bf16 peak, which this run lacks
        rates["bf16_peak"] = dict(zip(("flops_per_s", "source"), peak_flops(platform, machine, torch.bfloat16)))
    return rates
