"""The torch backend reads expert row bounds back to the host only where a per-expert loop slices by them."""

import pytest
import torch

from optimus.host_syncs import HostSyncCounter
from optimus.kernels import reference, torch_backend
from optimus.kernels.torch_private import FakeTensorMode
from tests.kernels.test_kernels_torch import NAMES, assert_close_rel, expert_path, make_problem, value_and_grads

pytestmark = pytest.mark.skipif(not torch_backend._HAS_GROUPED_MM, reason="this torch has no grouped_mm")


def expert_path_and_grouped_mm(leaves, token_idx_A, offsets_E):
    """Values and gradients of the expert path and of grouped_mm_op on its permuted rows."""
    results = value_and_grads(torch_backend, leaves, token_idx_A, offsets_E)
    x_AD = leaves[0].detach().index_select(0, token_idx_A).requires_grad_()
    y_AN = torch_backend.grouped_mm_op(x_AD, leaves[1], offsets_E)
    return results + [y_AN, *torch.autograd.grad(y_AN, (x_AD, leaves[1]), torch.ones_like(y_AN))]


def test_grouped_mm_path_reads_no_bounds_back(monkeypatch):
    """fp32 on a CPU with few experts takes torch's grouped GEMM, as bf16 on a GPU does: forward and backward of
    the expert MLP and of the grouped GEMM read nothing back (the CPU's combine and permute backward do: they
    run outside the counter)."""
    leaves, token_idx_A, offsets_E = make_problem(24, 16, 24, 4, 2, empty_experts=(1,))
    x_AD = leaves[0].detach()[token_idx_A].requires_grad_()
    w13, w2 = leaves[1], leaves[2]
    calls = []
    grouped_mm = torch_backend.torch_grouped_mm
    monkeypatch.setattr(torch_backend, "torch_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    with HostSyncCounter() as counter:
        y_AD = torch_backend.expert_swiglu_mlp(x_AD, w13, w2, offsets_E)
        got = [y_AD, *torch.autograd.grad(y_AD, (x_AD, w13, w2), torch.ones_like(y_AD))]
        y_AN = torch_backend.grouped_mm_op(x_AD, w13, offsets_E)
        got += [y_AN, *torch.autograd.grad(y_AN, (x_AD, w13), torch.ones_like(y_AN))]
    assert dict(counter.counts) == {}
    assert len(calls) == 2 + 4 + 1 + 2  # every GEMM of both forwards and backwards
    y_ref = reference.expert_swiglu_mlp(x_AD, w13, w2, offsets_E)
    want = [y_ref, *torch.autograd.grad(y_ref, (x_AD, w13, w2), torch.ones_like(y_ref))]
    y_ref = reference.grouped_mm(x_AD, w13, offsets_E)
    want += [y_ref, *torch.autograd.grad(y_ref, (x_AD, w13), torch.ones_like(y_ref))]
    for name, g, w in zip(["y", "dx", "dw13", "dw2", "mm y", "mm dx", "mm dw"], got, want):
        assert_close_rel(g, w, 1e-5, name)


def test_the_loop_reads_the_bounds_once_for_forward_and_backward(monkeypatch):
    monkeypatch.setattr(torch_backend, "_HAS_GROUPED_MM", False)
    leaves, token_idx_A, offsets_E = make_problem(24, 16, 24, 4, 2)
    x_AD = leaves[0].detach()[token_idx_A].requires_grad_()
    with HostSyncCounter() as counter:
        y_AD = torch_backend.expert_swiglu_mlp(x_AD, leaves[1], leaves[2], offsets_E)
        torch.autograd.grad(y_AD, (x_AD, leaves[1], leaves[2]), torch.ones_like(y_AD))
    assert sum(counter.counts.values()) == 1
    assert next(iter(counter.counts)).startswith("optimus/kernels/torch_backend.py:")


# A fake CUDA tensor needs a torch built with CUDA (a CPU-only build fails even views of one); its autograd
# graph needs a GPU too (the engine asks the device for its current stream, pytorch#92627).
CUDA_BUILD = pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a CUDA build")


@pytest.mark.parametrize(
    "device, dtype", [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=CUDA_BUILD)]
)
def test_the_grouped_mm_path_runs_on_fake_tensors(device, dtype):
    """The whole expert path and grouped_mm_op where they take torch's grouped GEMM (fp32 on a CPU with few
    experts, bf16 on a GPU), on fake tensors, which fail any value read: they run, reading nothing, with
    outputs and gradients shaped as in a real run."""
    with_grad = device == "cpu" or torch.cuda.is_available()
    leaves, token_idx_A, offsets_E = make_problem(24, 16, 24, 4, 2, dtype=dtype)
    want = [(t.shape, t.dtype) for t in expert_path_and_grouped_mm(leaves, token_idx_A, offsets_E)]
    if device == "cuda" and with_grad:
        torch.empty(1, device="cuda")  # a real CUDA context first, which backward on fake CUDA tensors assumes
    with FakeTensorMode(), torch.set_grad_enabled(with_grad), HostSyncCounter() as counter:
        *fakes, fake_idx, fake_offsets = [torch.empty(t.shape, dtype=t.dtype, device=device)
                                          for t in (*leaves, token_idx_A, offsets_E)]  # fmt: skip
        fakes = [t.requires_grad_(with_grad) for t in fakes]
        if with_grad:
            got = expert_path_and_grouped_mm(fakes, fake_idx, fake_offsets)
        else:
            got = [expert_path(torch_backend, fakes, fake_idx, fake_offsets),
                   torch_backend.grouped_mm_op(fakes[0].index_select(0, fake_idx), fakes[1], fake_offsets)]  # fmt: skip
    assert dict(counter.counts) == {}
    assert {t.device.type for t in got} == {device}
    assert [(t.shape, t.dtype) for t in got] == (want if with_grad else [want[0], want[len(NAMES)]])
