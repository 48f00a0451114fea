"""Which dtype the expert path computes in, shared by every backend.

Under `torch.autocast` the expert path computes in the autocast dtype (autocast
itself does not cover `torch._grouped_mm` or custom kernels); outside autocast it
computes in the dtype of its input.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch


def on_cpu(where: torch.Tensor | torch.device) -> bool:
    """Whether the expert path takes a CPU's schedules for tensors on this device (or this tensor's): the kernels'
    one test of "is this a CPU". Any other device - a GPU, or a dry run's stand-in for one - takes the
    accelerator's schedule."""
    device = where.device if isinstance(where, torch.Tensor) else where
    return device.type == "cpu"


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for t's device, else t's own dtype."""
    device_type = t.device.type
    if t.is_floating_point() and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


# CPU flags of native bf16 matmul units. torch's capability string says "AVX512" for any AVX-512 CPU,
# with or without them, so the flags themselves are read.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """True when this CPU (or the given /proc/cpuinfo text) has AVX512-BF16 or AMX units.

    Without them PyTorch's bf16/fp16 CPU matmul is a scalar fallback that runs at a few
    GFLOP/s, far below the fp32 BLAS path; `train.dtype=auto` uses the same test.
    """
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return any(flag in flags for flag in CPU_BF16_FLAGS)


@functools.cache
def cpu_has_fast_half_gemm() -> bool:
    """This machine's answer of `cpu_has_fast_bf16`, read once."""
    return cpu_has_fast_bf16()


def math_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype GEMMs run in for values of `dtype`: fp32 for 16-bit floats on a CPU without 16-bit units.

    Upcasting 16-bit operands to fp32 and accumulating in fp32 is exactly a 16-bit GEMM with
    fp32 accumulation (products of 16-bit floats are exact in fp32), only faster on such CPUs.
    """
    if dtype in (torch.bfloat16, torch.float16) and on_cpu(device) and not cpu_has_fast_half_gemm():
        return torch.float32
    return dtype


def round_to(t: torch.Tensor, dtype: torch.dtype, math: torch.dtype) -> torch.Tensor:
    """t rounded to `dtype` and held in `math` (no copy when both already match)."""
    return t.to(dtype).to(math)
