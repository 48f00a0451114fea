"""The device path: a GPU's step traced on a CPU-only machine, on fake tensors of the stand-in device.

References: torch's own CUDA autocast policy (run on fake `cuda` tensors, whose forward a CPU-only torch runs), the
same expert-path code on real CPU tensors with the accelerator's schedule forced, and the CPU path's own trace.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from optimus import kernels
from optimus.config import ConfigError, MachineConfig
from optimus.dry_run import dry_run_device, dry_run_rank
from optimus.fake_device import STAND_IN, stand_in
from optimus.kernels import dtypes, get_backend, torch_backend
from optimus.kernels.torch_private import FakeTensorMode
from optimus.operators import OperatorCounter
from optimus.plan import planned_kernels
from optimus.platform import Platform, declared_device_path, detect_platform, stand_in_platform
from optimus.recipes import load_config

# What only a CPU's step contains: its attention kernel, the CSR combine, and (in the collectives) gloo's
# reduce-scatter issued as an all-to-all in the optimizer.
CPU_ONLY_OPERATORS = {
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward",
    "aten._sparse_mm",
    "aten._sparse_addmm",
    "aten._to_sparse_csr",
}


def test_stand_in_runs_a_matmul_and_its_backward_on_fake_tensors():
    device = stand_in("cuda")
    with FakeTensorMode():
        a = torch.randn(64, 32, device=device, requires_grad=True)
        b = torch.randn(32, 16, device=device, requires_grad=True)
        (a @ b).sum().backward()
        assert a.grad.shape == (64, 32) and a.grad.device.type == STAND_IN
        assert b.grad.shape == (32, 16)


@pytest.mark.parametrize("path", ["cuda", "xpu"])
def test_stand_in_autocast_makes_the_casts_of_the_device_it_stands_for(path):
    """Each operator's output dtype under the stand-in's autocast equals the one under the real device's autocast
    (torch's AutocastCUDA / AutocastXPU kernels, run here on fake tensors of that device: forward only)."""
    target = "cuda" if path == "cuda" else "xpu"

    def dtypes_on(device, device_type):
        # torch.autocast turns itself off for a device torch cannot see: switched on below it, as it does
        enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
        torch.set_autocast_enabled(device_type, True)
        torch.set_autocast_dtype(device_type, torch.bfloat16)
        try:
            with FakeTensorMode():
                x = torch.randn(8, 16, device=device)
                w = torch.randn(16, 16, device=device)
                mm = x @ w
                return [mm.dtype, torch.softmax(mm, -1).dtype, F.rms_norm(mm, (16,)).dtype, (mm + x).dtype,
                        F.linear(x, w).dtype, torch.cat([mm, x]).dtype]  # fmt: skip
        finally:
            torch.set_autocast_enabled(device_type, enabled)
            torch.set_autocast_dtype(device_type, dtype)

    want = dtypes_on(torch.device(target), target)
    assert want[0] == torch.bfloat16 and want[1] == torch.float32  # the reference does cast
    assert dtypes_on(stand_in(path), STAND_IN) == want


def test_stand_in_attention_is_the_fused_kernel_with_its_backward():
    with FakeTensorMode():
        q = torch.randn(2, 4, 128, 64, device=stand_in("cuda"), dtype=torch.bfloat16, requires_grad=True)
        counter = OperatorCounter()
        with counter:
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    ops = set(counter.operators)
    assert {"aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_backward"} <= ops
    assert "aten.bmm" not in ops  # not the math path, which keeps the [S, S] probabilities


def test_platform_path_is_the_one_answer_for_every_vendor():
    cpu = Platform("cpu", "cpu", torch.device("cpu"), "gloo", "a cpu")
    assert (cpu.path, cpu.traced) == ("cpu", False)
    assert Platform("cuda", "amd", torch.device("cuda", 0), "nccl", "MI250X").path == "rocm"
    for path, backend in (("cuda", "nccl"), ("rocm", "nccl"), ("xpu", "xccl")):
        p = stand_in_platform(path)
        assert (p.path, p.traced, p.backend, p.device.type) == (path, True, backend, STAND_IN)


def test_declared_device_path_takes_rocm_and_a_real_run_refuses_what_is_not_here():
    assert declared_device_path(MachineConfig(device="rocm")) == "rocm"
    assert declared_device_path(MachineConfig(device="xpu")) == "xpu"
    with pytest.raises(ConfigError, match="set it to auto, cpu, cuda, rocm or xpu"):
        declared_device_path(MachineConfig(device="tpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch sees no CUDA/ROCm GPU"):
            detect_platform(MachineConfig(device="rocm"), 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="registers the stand-in, which would break this GPU's tests")
def test_a_process_with_the_stand_in_refuses_a_real_gpu():
    """The stand-in (registered by the tests' conftest, as by a dry run) would break a real GPU's backward: the
    step's build refuses a real GPU in such a process, before it touches the device."""
    from optimus.run_spec import resolve_run
    from optimus.train.step import parallel_state_of

    stand_in("cuda")
    gpu = Platform("cuda", "nvidia", torch.device("cuda", 0), "nccl", "a GPU")
    spec = resolve_run(load_config(["model=tiny"]), 1, gpu)
    with pytest.raises(RuntimeError, match="run the GPU's step in a fresh process"):
        parallel_state_of(spec)


def test_auto_kernels_follow_the_device_the_step_runs_on(monkeypatch):
    monkeypatch.setattr(kernels, "gpu_present", lambda: True)  # a GPU node ...
    monkeypatch.setattr(kernels, "triton_compiles", lambda: True)
    assert get_backend("auto", "cpu").name == "torch"  # ... whose CPU tensors take the CPU's kernels
    if kernels.triton_importable():
        assert get_backend("auto", "cuda").name == "triton"
    monkeypatch.setattr(kernels, "gpu_present", lambda: False)
    monkeypatch.setattr(kernels, "triton_compiles", lambda: False)  # no GPU to compile on: a trace trusts it
    assert get_backend("auto", STAND_IN, traced=True).name == ("triton" if kernels.triton_importable() else "torch")
    assert get_backend("auto", STAND_IN, traced=False).name == "torch"


def _expert_path_operators(x_TD, token_idx_A, weight_A, w13, w2, offsets_E) -> set[str]:
    backend = get_backend("torch")
    counter = OperatorCounter()
    with counter:
        x_AD = backend.permute(x_TD, token_idx_A)
        y_AD = backend.expert_swiglu_mlp(x_AD, w13, w2, offsets_E)
        backend.combine(y_AD, token_idx_A, weight_A, x_TD.shape[0]).float().sum().backward()
    return set(counter.operators)


def test_the_stand_ins_expert_path_issues_the_operators_of_the_accelerator_schedule(monkeypatch):
    """kernels=torch on the stand-in, against the same code on real CPU tensors with the accelerator's schedule
    forced (the kernels' one CPU test answering no): the same operators, grouped GEMMs and no per-expert loop."""
    T, D, F_, E, K = 64, 32, 48, 4, 2

    def problem(device):  # (made on the device: the stand-in holds only fake tensors of the active mode)
        token_idx_A = torch.arange(T, device=device).repeat_interleave(K)
        offsets_E = torch.full((E,), T * K // E, device=device).cumsum(0).to(torch.int32)
        x = torch.randn(T, D, dtype=torch.bfloat16, device=device, requires_grad=True)
        w13 = torch.randn(E, D, 2 * F_, dtype=torch.bfloat16, device=device, requires_grad=True)
        w2 = torch.randn(E, F_, D, dtype=torch.bfloat16, device=device, requires_grad=True)
        weight = torch.rand(T * K, dtype=torch.bfloat16, device=device, requires_grad=True)
        return x, token_idx_A, weight, w13, w2, offsets_E

    with monkeypatch.context() as patch:
        patch.setattr(torch_backend, "on_cpu", lambda where: False)
        patch.setattr(dtypes, "on_cpu", lambda where: False)
        forced = _expert_path_operators(*problem("cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        traced = _expert_path_operators(*problem(stand_in("cuda")))
    assert "aten._grouped_mm" in traced and "aten._grouped_mm" in forced
    assert traced == forced
    cpu = _expert_path_operators(*problem("cpu"))
    assert cpu != traced  # the CPU's own schedule is another one


@pytest.fixture(scope="module")
def moe_layout():
    return load_config(["model=tiny", "parallel.ep=2", "train.micro_batch=2", "train.global_batch=8"])


@pytest.fixture(scope="module")
def cuda_trace(moe_layout):
    return dry_run_rank(moe_layout, 4, 0, device="cuda")


def test_a_cuda_trace_contains_the_gpus_kernels_and_no_cpu_schedule(cuda_trace):
    ops = set(cuda_trace["operators"])
    assert cuda_trace["device"] == "cuda"
    assert "c10d._reduce_scatter_base_" in ops  # the sharded optimizer's native reduce-scatter
    assert "aten._scaled_dot_product_flash_attention" in ops
    # bf16 weights with fp32 gradients under ZeRO-1: the weight-gradient kernel adds into the optimizer's buffer
    expert = {"optimus.triton_swiglu_mlp", "optimus.triton_grouped_wgrad_into"}
    assert expert <= ops if cuda_trace["kernels"] == "triton" else "aten._grouped_mm" in ops
    assert not ops & CPU_ONLY_OPERATORS
    optimizer_calls = [c["op"] for c in cuda_trace["collectives"] if c["phase"] == "optimizer"]
    assert "all_to_all" not in optimizer_calls and "reduce_scatter" in optimizer_calls
    assert not [s for s in cuda_trace["host_syncs"] if "torch_backend" in s["where"]]  # no host read of row bounds
    json.dumps(cuda_trace)  # a rank file


def test_a_cuda_traces_memory_is_the_plan_for_its_kernels(cuda_trace):
    """The plan of the device path counts what its expert kernels keep (Triton's: h13 and h, not silu(gate))."""
    memory = cuda_trace["memory"]
    assert abs(memory["peak_bytes"] / memory["planned_bytes"] - 1) < 0.05, memory
    cfg = load_config(["model=tiny"])
    assert planned_kernels(cfg, "cpu") == "torch"
    assert planned_kernels(cfg, "cuda") == cuda_trace["kernels"]


def test_the_cpu_trace_of_the_same_layout_shows_what_the_cuda_trace_must_not(moe_layout, cuda_trace):
    """The markers above are real: the CPU path's trace of the same rank has them."""
    cpu = dry_run_rank(moe_layout, 4, 0, device="cpu")
    assert cpu["device"] == "cpu" and cpu["kernels"] == "torch"
    assert set(cpu["operators"]) & CPU_ONLY_OPERATORS
    assert "all_to_all" in [c["op"] for c in cpu["collectives"] if c["phase"] == "optimizer"]
    # The same collectives otherwise: the layout's groups and the exchange are the device's business alone.
    kinds = [(c["op"], c["group"]) for c in cpu["collectives"] if c["phase"] != "optimizer"]
    assert kinds == [(c["op"], c["group"]) for c in cuda_trace["collectives"] if c["phase"] != "optimizer"]
    # The same matrix-product and attention FLOPs, in the CPU's kernels or the GPU's (Triton's custom operators
    # carry their own FLOP formulas).
    flops = [sum(o["flops"] for o in trace["operators"].values()) for trace in (cpu, cuda_trace)]
    assert flops[0] == flops[1] > 0


def test_a_dry_run_traces_the_recipes_own_device_by_default():
    assert dry_run_device(load_config(["experiment=aurora-mula-7b-a1b"]), None) == "xpu"
    assert dry_run_device(load_config(["experiment=frontier-mula-20b-a2b"]), None) == "rocm"
    assert dry_run_device(load_config(["experiment=frontier-mula-20b-a2b"]), "cpu") == "cpu"
    with pytest.raises(ConfigError, match="--device tpu is not supported"):
        dry_run_device(load_config(["model=tiny"]), "tpu")


def test_the_rank_file_says_which_path_and_kernels_it_traced(tmp_path):
    from optimus.cli import main

    out = tmp_path / "dry"
    args = ["plan", "--dry-run", "--world", "4", "--device", "rocm", "--rank", "1", "--out", str(out)]
    assert main([*args, "model=tiny", "parallel.ep=2", "train.micro_batch=2", "train.global_batch=8"]) == 0
    rank = json.loads((out / "rank1.json").read_text())
    assert rank["device"] == "rocm" and rank["kernels"] in ("triton", "torch")
    assert all(set(row) == {"calls", "flops", "bytes"} for row in rank["operators"].values())
    assert json.loads((out / "dry_run.json").read_text())["device"] == "rocm"
