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

from optimus.kernels import get_backend, reference  # noqa: E402
from tests.kernels.test_kernels_torch import NAMES, assert_close_rel, make_problem, value_and_grads  # noqa: E402

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
