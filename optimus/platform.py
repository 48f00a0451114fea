"""Which accelerator this rank drives, on which device path, with which collective backend, in which dtype.

Its peak FLOP/s is optimus.peak_flops, its memory optimus.device_memory, a CPU rank's share of the machine
optimus.cpu_runtime.

Intel GPUs appear as `xpu`; AMD GPUs under ROCm appear as `cuda` (torch.version.hip is set)
and use RCCL through the `nccl` backend name; NVIDIA GPUs are `cuda` + NCCL; CPUs use gloo.
"""

from __future__ import annotations

import importlib
import logging
import platform as _pyplatform
from dataclasses import dataclass

import torch

from optimus.config import ConfigError, MachineConfig
from optimus.fake_device import STAND_IN
from optimus.kernels.dtypes import cpu_has_fast_bf16

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
