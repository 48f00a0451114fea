"""The triton backend's custom operators: torch.library's own checks, and runs on fake tensors (shapes alone).

Every fake run is compared with a real run of the same shapes (the kernels under the Triton interpreter on a
CPU): each output and gradient must have the real one's shape, dtype and strides.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the triton backend is optional")

import optimus.kernels as kernels  # noqa: E402
from optimus.kernels import get_backend  # noqa: E402
from tests.kernels.test_kernels_torch import expert_path, make_problem, value_and_grads  # noqa: E402
from tests.kernels.test_kernels_triton import DEVICE, to_device  # noqa: E402  (sets TRITON_INTERPRET without a GPU)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def metadata(tensors) -> list[tuple]:
    return [(tuple(t.shape), t.dtype, t.stride()) for t in tensors]


def fake_like(tensors, device: str):
    """Inside a FakeTensorMode: fakes of `tensors` on `device`, with their strides, float ones requiring grad."""
    fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in tensors]
    return [f.requires_grad_(t.requires_grad) for f, t in zip(fakes, tensors)]


def expert_problem(dtype):
    # D=20, F=24, not multiples of the interpreter's tile; expert 1 has no rows.
    return to_device(*make_problem(12, 20, 24, 4, 2, dtype=dtype, empty_experts=(1,)))


def grouped_mm_problem(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(13, 20, generator=gen).to(DEVICE, dtype).requires_grad_()
    w = torch.randn(3, 20, 24, generator=gen).to(DEVICE, dtype).requires_grad_()
    return x, w, torch.tensor([5, 5, 13], dtype=torch.int32, device=DEVICE)


def grouped_mm_value_and_grads(backend, x, w, offsets):
    y = backend.grouped_mm(x, w, offsets)
    return [y, *torch.autograd.grad(y, (x, w), torch.ones_like(y))]


# ---- torch.library.opcheck: schema, autograd registration, fake vs real outputs, tracing forward and backward ----


OPCHECK_CASES = [
    "permute",
    "permute_to_fp16",
    "combine",
    "swiglu_mlp",
    "swiglu_mlp_fp16",
    "grouped_mm",
    "grouped_mm_transposed_w",
    "segment_sum",
    "combine_grads",
    "swiglu_backward",
    "grouped_wgrad",
    "grouped_wgrad_into",
    "row_dot",
    "row_dot_weighted",
    "rms_norm",
    "rms_norm_summed",
    "rms_norm_backward",
    "rms_norm_backward_summed",
    "rope",
    "rope_inverse_to_fp32",
]


def opcheck_cases() -> dict:
    """Every operator of optimus::triton_*, with arguments; inputs that require grad where it is differentiable."""
    get_backend("triton")  # imports optimus.kernels.triton_backend, which registers the operators
    (x_TD, w13, w2, weight_A), token_idx_A, offsets_E = expert_problem(torch.float32)
    x_AD = x_TD.detach()[token_idx_A].requires_grad_()  # [24, 20]
    half_AD = x_AD.detach().half().requires_grad_()  # 16-bit rows, fp32 weights: what autocast hands the MLP
    rows_AD, h13_AF2 = x_AD.detach(), torch.randn(24, 48)
    order_A = torch.argsort(token_idx_A, stable=True)
    seg_end_T = torch.cumsum(torch.bincount(token_idx_A), 0).to(torch.int32)
    fp32 = torch.float32
    ops = torch.ops.optimus
    # RMSNorm's rows: 5 of width 20 in bf16 with an fp32 weight; the *_summed cases take the rows' sums over a
    # width of 40 (another rank's 20 columns added) where the kernel would compute them
    gen = torch.Generator().manual_seed(5)
    x_ND, g_ND = (torch.randn(5, 20, generator=gen).bfloat16() for _ in range(2))
    w_D, rstd_N = torch.rand(20, generator=gen) + 0.5, torch.rand(5, generator=gen) + 0.5
    sums_N = torch.rand(5, generator=gen) * 40
    # RoPE: q [B 1, N 2, S 3, H 8] in bf16 as attention hands it, a transposed [B, S, N, H] projection
    q_BNSH = torch.randn(1, 3, 2, 8, generator=gen).bfloat16().transpose(1, 2)
    cos_SH, sin_SH = torch.rand(3, 4, generator=gen), torch.rand(3, 4, generator=gen)
    return {
        "permute": (ops.triton_permute, (x_TD, token_idx_A, fp32)),
        "permute_to_fp16": (ops.triton_permute, (x_TD, token_idx_A, torch.float16)),
        "combine": (ops.triton_combine, (x_AD, token_idx_A, weight_A, 12, fp32)),
        "swiglu_mlp": (ops.triton_swiglu_mlp, (x_AD, w13, w2, offsets_E, fp32)),
        "swiglu_mlp_fp16": (ops.triton_swiglu_mlp, (half_AD, w13, w2, offsets_E, torch.float16)),
        "grouped_mm": (ops.triton_grouped_mm, (x_AD, w13, offsets_E, fp32)),
        "grouped_mm_transposed_w": (ops.triton_grouped_mm, (x_AD, w2.transpose(1, 2), offsets_E, fp32)),
        "segment_sum": (ops.triton_segment_sum, (rows_AD, order_A, seg_end_T, fp32)),
        "combine_grads": (ops.triton_combine_grads, (x_TD.detach(), rows_AD, token_idx_A, weight_A.detach(), fp32)),
        "swiglu_backward": (ops.triton_swiglu_backward, (rows_AD, w2.detach(), h13_AF2, offsets_E)),
        "grouped_wgrad": (ops.triton_grouped_wgrad, (rows_AD, rows_AD, offsets_E, fp32)),
        "grouped_wgrad_into": (ops.triton_grouped_wgrad_into, (rows_AD, rows_AD, offsets_E, torch.zeros(4, 20, 20))),
        "row_dot": (ops.triton_row_dot, (x_ND, x_ND, None)),
        "row_dot_weighted": (ops.triton_row_dot, (g_ND, x_ND, w_D)),
        "rms_norm": (ops.triton_rms_norm, (x_ND, w_D, 1e-6, 20, None)),
        "rms_norm_summed": (ops.triton_rms_norm, (x_ND, w_D, 1e-6, 40, sums_N)),
        "rms_norm_backward": (ops.triton_rms_norm_backward, (g_ND, x_ND, w_D, rstd_N, 20, None)),
        "rms_norm_backward_summed": (ops.triton_rms_norm_backward, (g_ND, x_ND, w_D, rstd_N, 40, sums_N)),
        "rope": (ops.triton_rope, (q_BNSH, cos_SH, sin_SH, False, torch.bfloat16)),
        "rope_inverse_to_fp32": (ops.triton_rope, (q_BNSH, cos_SH, sin_SH, True, fp32)),
    }


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_custom_op_passes_opcheck(case):
    cases = opcheck_cases()
    assert list(cases) == OPCHECK_CASES
    op, args = cases[case]
    results = torch.library.opcheck(op, args)
    assert set(results.values()) == {"SUCCESS"}, results


# ---- the backend on fake tensors ----


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_forward_and_backward_run_on_shapes_alone(dtype):
    """Fake CPU tensors: the kernels cannot run, so every op of the forward and the backward, the custom
    operators' included, runs on its fake implementation (and nothing reads a value: FakeTensorMode would
    raise). The outputs and gradients match the real run's in shape, dtype and strides."""
    backend = get_backend("triton")
    leaves, token_idx_A, offsets_E = expert_problem(dtype)
    x, w, offsets = grouped_mm_problem(dtype)
    want = metadata(value_and_grads(backend, leaves, token_idx_A, offsets_E))
    want_mm = metadata(grouped_mm_value_and_grads(backend, x, w, offsets))
    with FakeTensorMode():
        *fake_leaves, fake_idx, fake_offsets = fake_like([*leaves, token_idx_A, offsets_E], "cpu")
        got = metadata(value_and_grads(backend, fake_leaves, fake_idx, fake_offsets))
        got_mm = metadata(grouped_mm_value_and_grads(backend, *fake_like([x, w, offsets], "cpu")))
    assert got == want
    assert got_mm == want_mm


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_a_gpu_selects_triton_and_it_runs_on_a_fake_cuda_device(monkeypatch, dtype):
    """What `kernels=auto` picks on a GPU where Triton compiles, run on a fake `cuda` device. The probes answer
    as such a machine would: they ask the hardware, which a fake device does not have.

    The backward runs too where the autograd engine can run on fake CUDA tensors: on a GPU (it asks the
    device for its current stream, pytorch#92627). Without one, a CPU-only torch aborts the process as soon
    as a fake CUDA tensor enters an autograd graph (it has no CUDA device guard), so the forward runs without
    one here; test_forward_and_backward_run_on_shapes_alone covers the backward's fake implementations."""
    monkeypatch.setattr(kernels, "gpu_present", lambda: True)
    monkeypatch.setattr(kernels, "triton_compiles", lambda: True)
    backend = get_backend("auto")
    assert backend.name == "triton"
    with_grad = torch.cuda.is_available()
    leaves, token_idx_A, offsets_E = expert_problem(dtype)
    want = metadata(value_and_grads(backend, leaves, token_idx_A, offsets_E)[: 6 if with_grad else 1])
    if with_grad:
        torch.empty(1, device="cuda")  # a real CUDA context first, which backward on fake CUDA tensors assumes
    with FakeTensorMode(), torch.set_grad_enabled(with_grad):
        *fake_leaves, fake_idx, fake_offsets = fake_like([*leaves, token_idx_A, offsets_E], "cuda")
        if with_grad:
            got = value_and_grads(backend, fake_leaves, fake_idx, fake_offsets)
        else:
            got = [expert_path(backend, [t.detach() for t in fake_leaves], fake_idx, fake_offsets)]
    assert {t.device.type for t in got} == {"cuda"}
    assert metadata(got) == want
