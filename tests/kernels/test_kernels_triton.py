"""The triton kernel backend against optimus.kernels.reference: values and every gradient.

Without a GPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set here
before the kernels are defined), so shapes stay tiny. The interpreter's tl.dot is wrong for
bf16 inputs, so bf16 cases run only on a GPU.
"""

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    # Triton fixes interpreted-or-compiled when it (and each kernel) is first imported.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: set it in tests/conftest.py.")
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the triton backend is optional")

from optimus.kernels import get_backend, grad_sink, reference  # noqa: E402
from tests.kernels.test_kernels_torch import (  # noqa: E402
    NAMES,
    assert_close_rel,
    expert_path,
    make_problem,
    value_and_grads,
)  # fmt: skip

DEVICE = "cuda" if ON_GPU else "cpu"
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(not ON_GPU, reason="the Triton interpreter computes tl.dot on bf16 inputs wrongly"),
)


def to_device(leaves, token_idx_A, offsets_E):
    leaves = [t.detach().to(DEVICE).requires_grad_() for t in leaves]
    return leaves, token_idx_A.to(DEVICE), offsets_E.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_expert_path_matches_reference(top_k, dtype):
    # D=20, F=24: neither a multiple of the 16-wide interpreter tile; ragged rows; expert 1 empty.
    n_tokens = 24 if top_k < 8 else 12  # the interpreter runs one Python step per program: keep A small
    problem = to_device(*make_problem(n_tokens, 20, 24, top_k + 2, top_k, dtype=dtype, empty_experts=(1,)))
    got = value_and_grads(get_backend("triton"), *problem)
    # The oracle runs in fp32 on the same (rounded) values.
    leaves32 = [t.detach().float().requires_grad_() for t in problem[0]]
    want = value_and_grads(reference, leaves32, *problem[1:])
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == dtype, name
        assert_close_rel(g.float(), w, rtol, name)


def test_grouped_mm_forward_input_and_weight_grads():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 20, generator=gen).to(DEVICE).requires_grad_()
    w = torch.randn(4, 20, 24, generator=gen).to(DEVICE).requires_grad_()
    offsets = torch.tensor([17, 17, 20, 37], dtype=torch.int32, device=DEVICE)  # expert 1 empty
    dy = torch.randn(37, 24, generator=gen).to(DEVICE)
    be = get_backend("triton")
    got = [be.grouped_mm(x, w, offsets)]
    got += torch.autograd.grad(got[0], (x, w), dy)
    want = [reference.grouped_mm(x, w, offsets)]
    want += torch.autograd.grad(want[0], (x, w), dy)
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert_close_rel(g, r, 1e-5, name)
    assert got[2][1].abs().max() == 0


def test_grouped_weight_gradient_of_two_parts_sums_both():
    # Two batches of rows for the same experts (two chunks of a micro-batch), their products summed in one pass:
    # written (the step's first), then added into an fp32 sum; ragged rows, an expert empty in one part only, and
    # the parts of different lengths. Against each expert's rows' x^T @ g, by part, added in fp32.
    from optimus.kernels import triton_kernels as tk

    gen = torch.Generator().manual_seed(7)
    parts, want = [], torch.zeros(4, 20, 24)
    for offsets in ([9, 9, 15, 21], [4, 10, 10, 30]):
        x = torch.randn(offsets[-1], 20, generator=gen)
        g = torch.randn(offsets[-1], 24, generator=gen)
        bounds = torch.tensor(offsets, dtype=torch.int32)
        for e, (lo, hi) in enumerate(zip([0, *offsets[:-1]], offsets)):
            want[e] += x[lo:hi].T @ g[lo:hi]
        parts.append(tuple(t.to(DEVICE) for t in (x, g, bounds)))
    written = tk.grouped_wgrad(*parts[0], torch.float32, second=parts[1])
    assert_close_rel(written.cpu(), want, 1e-5, "two parts, written")
    total = torch.randn(4, 20, 24, generator=gen)
    added = total.to(DEVICE).clone()
    tk.grouped_wgrad_into(*parts[0], added, second=parts[1])
    assert_close_rel(added.cpu(), total + want, 1e-5, "two parts, added")


class _FlatBuffer:
    """An optimizer's stand-in for grad_sink: one flat buffer, the weight of key k at elements spans[k]."""

    def __init__(self, flat: torch.Tensor, spans: list[tuple[int, int]]):
        self.flat, self.spans = flat, spans

    def sink_for(self, key: int) -> torch.Tensor:
        start, numel = self.spans[key]
        return self.flat[start : start + numel]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_weight_gradients_are_added_into_offered_sinks(dtype):
    # The optimizer offers fp32 buffers (grad_sink); the weight-gradient kernel adds into them, twice here (two
    # micro-batches), marks the weights (what autograd stores holds nothing), and leaves the input gradients alone.
    leaves, token_idx_A, offsets_E = to_device(*make_problem(12, 20, 24, 4, 2, dtype=dtype, empty_experts=(1,)))
    x_TD, w13, w2, weight_A = leaves
    buffer = torch.randn(3 + w13.numel() + w2.numel(), device=DEVICE)  # what earlier gradients left there
    before = buffer.clone()
    owner = _FlatBuffer(buffer, [(3, w13.numel()), (3 + w13.numel(), w2.numel())])
    grad_sink.attach(w13, owner, 0)
    grad_sink.attach(w2, owner, 1)
    be, dout = get_backend("triton"), torch.randn(12, 20, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for _ in range(2):
        expert_path(be, leaves, token_idx_A, offsets_E).backward(dout.to(dtype))
        assert grad_sink.take_added(w13) and grad_sink.take_added(w2)  # what .grad got holds nothing
        w13.grad = w2.grad = None
    dx, dweight = x_TD.grad / 2, weight_A.grad / 2
    # The oracle: fp32 gradients of the same (rounded) values, two of them.
    leaves32 = [t.detach().float().requires_grad_() for t in leaves]
    want = torch.autograd.grad(expert_path(reference, leaves32, token_idx_A, offsets_E), leaves32, dout)
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close_rel(dx.float(), want[0], rtol, "d x")
    assert_close_rel(dweight.float(), want[3], rtol, "d weight")
    added = buffer - before
    assert added[:3].abs().max() == 0
    assert_close_rel(added[3 : 3 + w13.numel()], 2 * want[1].flatten(), rtol, "d w13")
    assert_close_rel(added[3 + w13.numel() :], 2 * want[2].flatten(), rtol, "d w2")
    del owner  # the sink holds its owner weakly: an optimizer that is gone leaves none
    assert grad_sink.sink_of(w13) is None
    out = expert_path(be, leaves, token_idx_A, offsets_E)
    assert not grad_sink.take_added(w2)
    assert_close_rel(torch.autograd.grad(out, w2, dout.to(dtype))[0].float(), want[2], rtol, "d w2 returned")


def test_fp16_autocast_computes_in_fp16():
    problem = to_device(*make_problem(16, 16, 16, 4, 2))
    want = value_and_grads(reference, *problem)
    with torch.autocast(DEVICE, dtype=torch.float16):
        got = value_and_grads(get_backend("triton"), *problem)
    assert got[0].dtype == torch.float16
    for name, g, w in zip(NAMES, got, want):
        if name != "out":
            assert g.dtype == torch.float32, name  # grads come back in the leaves' dtype
        assert_close_rel(g.float(), w, 2e-2, name)
