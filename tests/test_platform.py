"""Accelerator, backend and peak FLOP/s selection, with torch's device probes mocked."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from optimus import device_memory, peak_flops
from optimus import platform as plat
from optimus.config import ConfigError, MachineConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def devices(monkeypatch):
    """Pretend torch sees `kind` devices: call it with kind in xpu | nvidia | rocm | cpu."""

    def install(kind: str, count: int = 4, name: str = "", oneccl: bool = False, engines: int = 448):
        monkeypatch.setattr(torch.xpu, "is_available", lambda: kind == "xpu")
        monkeypatch.setattr(torch.xpu, "device_count", lambda: count if kind == "xpu" else 0)
        monkeypatch.setattr(torch.xpu, "get_device_name", lambda i=0: name)
        properties = types.SimpleNamespace(name=name, gpu_eu_count=engines)  # what torch.xpu's properties hold
        monkeypatch.setattr(torch.xpu, "get_device_properties", lambda i=0: properties)
        gpu = kind in ("nvidia", "rocm")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count if gpu else 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
        monkeypatch.setattr(torch.version, "hip", "6.2.41133" if kind == "rocm" else None)
        # sys.modules[name] = None makes `import name` raise ImportError; a module object imports.
        fake = types.ModuleType("oneccl_bindings_for_pytorch") if oneccl else None
        monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", fake)

    return install


def test_auto_prefers_xpu_and_uses_xccl_without_oneccl(devices):
    devices("xpu", count=12, name="Intel(R) Data Center GPU Max 1550")
    p = plat.detect_platform(MachineConfig(), local_rank=7)
    assert (p.device_type, p.vendor, p.backend) == ("xpu", "intel", "xccl")
    assert p.device == torch.device("xpu", 7)
    assert p.engines == 448 and peak_flops.peak_flops_per_device(p, MachineConfig())[0] == pytest.approx(
        367.0e12, rel=1e-3
    )


def test_xpu_uses_ccl_when_oneccl_bindings_import(devices):
    devices("xpu", count=12, oneccl=True)
    assert plat.detect_platform(MachineConfig(), 0).backend == "ccl"


def test_rocm_is_cuda_with_amd_vendor_and_nccl(devices):
    devices("rocm", count=8, name="AMD Instinct MI250X")
    p = plat.detect_platform(MachineConfig(device="cuda"), local_rank=3)
    assert (p.device_type, p.vendor, p.backend, p.device) == ("cuda", "amd", "nccl", torch.device("cuda", 3))


def test_nvidia(devices):
    devices("nvidia", count=8, name="NVIDIA H100 80GB HBM3")
    p = plat.detect_platform(MachineConfig(), local_rank=5)
    assert (p.device_type, p.vendor, p.backend, p.device_name) == ("cuda", "nvidia", "nccl", "NVIDIA H100 80GB HBM3")


def test_cpu_when_nothing_else(devices):
    devices("cpu")
    p = plat.detect_platform(MachineConfig(), local_rank=3)
    assert (p.device_type, p.vendor, p.backend, p.device) == ("cpu", "cpu", "gloo", torch.device("cpu"))


@pytest.mark.parametrize("visible, local_rank, index", [(1, 5, 0), (8, 5, 5), (8, 11, 3), (12, 11, 11)])
def test_device_index_is_local_rank_modulo_visible_devices(devices, visible, local_rank, index):
    # A launcher that masks devices per rank (ZE_AFFINITY_MASK, ROCR_VISIBLE_DEVICES) leaves one visible.
    devices("nvidia", count=visible)
    assert plat.detect_platform(MachineConfig(), local_rank).device.index == index


def test_backend_override_and_its_checks(devices):
    devices("nvidia", count=8)
    assert plat.detect_platform(MachineConfig(backend="gloo"), 0).backend == "gloo"
    with pytest.raises(ConfigError, match=r"machine.backend='xccl' cannot drive a cuda device"):
        plat.detect_platform(MachineConfig(backend="xccl"), 0)
    devices("xpu", count=12, oneccl=False)
    with pytest.raises(ConfigError, match=r"machine.backend=ccl needs oneccl_bindings_for_pytorch"):
        plat.detect_platform(MachineConfig(backend="ccl"), 0)


def test_explicit_device_must_exist(devices):
    devices("cpu")
    with pytest.raises(ConfigError, match=r"machine.device=xpu but torch sees no Intel GPU"):
        plat.detect_platform(MachineConfig(device="xpu"), 0)
    with pytest.raises(ConfigError, match=r"machine.device=cuda"):
        plat.detect_platform(MachineConfig(device="cuda"), 0)
    with pytest.raises(ConfigError, match=r"machine.device='tpu' is not supported"):
        plat.detect_platform(MachineConfig(device="tpu"), 0)
    devices("xpu", count=12)  # an explicit cpu stays cpu even with a GPU present
    assert plat.detect_platform(MachineConfig(device="cpu"), 0).device_type == "cpu"


@pytest.mark.parametrize(
    "name, flops",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756.0e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA GH200 480GB", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312.0e12),
        ("AMD Instinct MI250X", 191.5e12),
        ("AMD Instinct MI250X/MI250", 191.5e12),
        ("AMD Instinct MI300X", 1307.4e12),
        ("Intel(R) Data Center GPU Max 1550", 419.4e12),
    ],
)
def test_peak_table(name, flops):
    p = plat.Platform("cuda", "nvidia", torch.device("cuda", 0), "nccl", name)
    assert peak_flops.peak_flops_per_device(p, MachineConfig()) == (flops, "table")


@pytest.mark.parametrize(
    "engines, flops",
    [(448, 419.4e12 * 448 / 512), (512, 419.4e12), (896, 2 * 419.4e12 * 448 / 512), (None, 419.4e12)],
    ids=["Aurora tile", "full tile", "Aurora card (COMPOSITE)", "engines unknown"],
)
def test_the_peak_counts_the_engines_the_device_has(engines, flops):
    # Intel's figure is for a tile with all 512 engines; Aurora's have 448 active (ALCF's machine overview).
    p = plat.Platform("xpu", "intel", torch.device("cpu"), "xccl", "Intel(R) Data Center GPU Max 1550", engines)
    assert peak_flops.peak_flops_per_device(p, MachineConfig()) == (pytest.approx(flops), "table")


def test_peak_config_wins_and_unknown_is_zero(caplog):
    p = plat.Platform("cuda", "nvidia", torch.device("cuda", 0), "nccl", "NVIDIA Mystery 9000")
    assert peak_flops.peak_flops_per_device(p, MachineConfig(peak_flops=123e12)) == (123e12, "config")
    assert peak_flops.peak_flops_per_device(p, MachineConfig()) == (0.0, "unknown")
    assert "NVIDIA Mystery 9000" in caplog.text and "machine.peak_flops" in caplog.text
    caplog.clear()
    peak_flops.peak_flops_per_device(p, MachineConfig())
    assert caplog.text == "", "the warning for an unknown device is given once"


def test_cpu_probe_measures_a_positive_rate():
    threads = torch.get_num_threads()
    assert peak_flops.cpu_matmul_probe(n=128, seconds=0.05) > 0
    assert peak_flops.cpu_matmul_probe(torch.float32, n=256, seconds=0.05) > 0
    assert torch.get_num_threads() == threads, "the probe must restore torch's thread count"
    cpu = plat.Platform("cpu", "cpu", torch.device("cpu"), "gloo", "some cpu")
    flops, source = peak_flops.peak_flops_per_device(cpu, MachineConfig(), dtype=torch.float32)
    assert flops > 0 and source == "cpu-probe"
    assert peak_flops.peak_flops_per_device(cpu, MachineConfig(), dtype=torch.float32) == (flops, "cpu-probe")  # cached
    assert device_memory.memory_allocated(cpu) == 0
    device_memory.synchronize(cpu)  # a no-op on CPU, must not raise


@pytest.mark.parametrize("name", ["local", "aurora", "frontier", "nvidia"])
def test_machine_recipes_match_the_schema(name):
    path = ROOT / "recipes" / "machine" / f"{name}.yaml"
    assert path.read_text().startswith("# @package machine\n")
    machine = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MachineConfig), OmegaConf.load(path)))
    assert machine.name == name
    expected = {"local": None, "aurora": 12, "frontier": 8, "nvidia": 8}[name]
    assert machine.ranks_per_node == expected
    if name in ("aurora", "frontier"):  # their peak is per device (tile / GCD), as in the table
        device_name = {"aurora": "Intel(R) Data Center GPU Max 1550", "frontier": "AMD Instinct MI250X"}[name]
        engines = {"aurora": 448, "frontier": None}[name]  # Aurora's tiles: 448 of 512 engines active
        assert machine.peak_flops == pytest.approx(peak_flops.lookup_peak_flops(device_name, engines), rel=1e-3)
        assert machine.memory_gb == 64


def test_cpu_threads_are_shared_among_local_ranks(monkeypatch):
    import torch

    from optimus.cpu_runtime import share_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    try:
        assert share_cpu_threads(4) == 2
        assert share_cpu_threads(16) == 1  # never below one thread
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(5)
        assert share_cpu_threads(4) == 5  # the user's setting wins
    finally:
        torch.set_num_threads(before)


_MMAPPED_BYTES_AROUND_A_64MB_TENSOR = """
import ctypes, sys
import torch
from optimus.cpu_runtime import keep_cpu_allocations

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_cpu_allocations()
before = libc.mallinfo2().hblkhd
t = torch.empty(16 * 2**20)  # 64 MB
print(libc.mallinfo2().hblkhd - before)
"""


def test_kept_cpu_allocations_are_not_mmapped():
    import ctypes
    import subprocess
    import sys

    try:
        hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2") or pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    except OSError:
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")

    def mmapped_bytes(mode):
        cmd = [sys.executable, "-c", _MMAPPED_BYTES_AROUND_A_64MB_TENSOR, mode]
        return int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

    assert mmapped_bytes("default") >= 64 * 2**20  # glibc's default: a large block is its own mmap
    assert mmapped_bytes("keep") == 0  # kept: it comes from the heap, which is not trimmed


_RESIDENT_DROP_AFTER_RELEASE = """
import torch
from optimus.cpu_runtime import keep_cpu_allocations, release_free_cpu_memory
from optimus.device_memory import proc_bytes

assert keep_cpu_allocations()
big = torch.ones(16 * 2**20)  # 64 MB, touched, from the heap
pin = torch.ones(1024)  # allocated above it: the heap cannot shrink from its top
del big
before = proc_bytes("/proc/self/status", "VmRSS")
released = release_free_cpu_memory()
print(int(released), before - proc_bytes("/proc/self/status", "VmRSS"))
"""


def test_released_free_cpu_memory_leaves_the_resident_set():
    """A freed 64 MB block inside the kept heap stays resident until release_free_cpu_memory hands it back."""
    import subprocess

    if device_memory.proc_bytes("/proc/self/status", "VmRSS") is None:
        pytest.skip("needs /proc (Linux)")
    out = subprocess.run([sys.executable, "-c", _RESIDENT_DROP_AFTER_RELEASE], capture_output=True, text=True)
    if out.returncode and "AssertionError" in out.stderr:
        pytest.skip("needs glibc (mallopt, malloc_trim)")
    out.check_returncode()
    released, dropped = map(int, out.stdout.split())
    assert released == 1
    assert dropped >= 48 * 2**20


def test_peak_resident_bytes_never_goes_down(monkeypatch):
    """VmHWM can read a little lower after memory is unmapped (the kernel folds per-thread counts in lazily):
    the peak reported so far stays the largest seen."""
    readings = iter([500 * 2**20, 499 * 2**20, 510 * 2**20])
    monkeypatch.setattr(device_memory, "_highest_resident", 0)
    monkeypatch.setattr(device_memory, "proc_bytes", lambda path, field: next(readings))
    assert [device_memory.peak_resident_bytes() for _ in range(3)] == [500 * 2**20, 500 * 2**20, 510 * 2**20]
