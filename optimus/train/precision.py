"""Choosing the compute dtype: `train.dtype=auto` picks bf16 only where bf16 matmuls are fast.

Accelerators (CUDA, ROCm, XPU) all have bf16 matrix units. CPUs differ: with
AVX512-BF16 or AMX a bf16 matmul is several times faster than fp32, without
them PyTorch emulates it and it is tens of times slower, so auto means fp32 there.
"""

from __future__ import annotations

from pathlib import Path

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def resolve_dtype(requested: str, device_type: str, cpuinfo: str | None = None) -> str:
    """`bf16` or `fp32` for `train.dtype=requested` on a device of `device_type`."""
    if requested != "auto":
        return requested
    if device_type != "cpu":
        return "bf16"
    return "bf16" if cpu_has_fast_bf16(cpuinfo) else "fp32"
