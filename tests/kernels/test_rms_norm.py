"""RMSNorm in each backend's arithmetic (optimus.kernels.rms_norm) against the formula in fp64: values, the input's
and the weight's gradients, over a whole width and over a width split between ranks.

Triton's kernels run under the interpreter without a GPU (tests.kernels.test_kernels_triton sets it up); the
shapes are small and neither the rows nor the width fill the interpreter's tiles.
"""

import pytest
import torch

from optimus.kernels import get_backend
from optimus.kernels.rms_norm import TORCH_NORM, rms_norm
from optimus.model.norm import RMSNorm

try:
    from tests.kernels.test_kernels_triton import DEVICE  # sets TRITON_INTERPRET without a GPU

    ARITHMETICS = {"torch": TORCH_NORM, "triton": get_backend("triton").rms_norm}
except pytest.skip.Exception:  # triton is not installed: the torch arithmetic alone
    DEVICE, ARITHMETICS = "cpu", {"torch": TORCH_NORM}

EPS = 1e-6


def formula(x, w):
    """y = x / sqrt(mean(x^2) + eps) * w in fp64."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS) * w.double()


def value_and_grads(fn, x, w, g):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    return [y, *torch.autograd.grad(y, (x, w), g.to(y.dtype))]


def problem(dtype, w_dtype, shape=(3, 7, 20)):
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(*shape, generator=gen) * 3).to(DEVICE, dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(DEVICE, w_dtype)
    return x, w, torch.randn(*shape, generator=gen).to(DEVICE)


def assert_close(got, want, dtype, what):
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 outputs: one rounding of a value near 1
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} against {scale:.3g}"


@pytest.mark.parametrize("name", list(ARITHMETICS))
@pytest.mark.parametrize(
    "dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]
)
def test_matches_the_formula(name, dtype, w_dtype):
    x, w, g = problem(dtype, w_dtype)
    got = value_and_grads(lambda x, w: rms_norm(x, w, EPS, ARITHMETICS[name]), x, w, g)
    want = value_and_grads(formula, x, w, g)
    assert (got[0].dtype, got[1].dtype, got[2].dtype) == (dtype, dtype, w_dtype)
    for what, a, b in zip(("y", "dx", "dw"), got, want):
        assert_close(a, b, dtype, what)


@pytest.mark.parametrize("name", list(ARITHMETICS))
def test_a_split_width_matches_the_whole(name):
    # The first 18 of 48 columns on this "rank"; the other rank's 30 columns add their per-row sums through
    # `reduce`: sum(x^2) in forward, then sum(g * w * x) in backward, as an all-reduce would.
    x, w, g = problem(torch.float32, torch.float32, shape=(5, 48))
    other = slice(18, 48)
    others = [
        x[:, other].double().square().sum(-1).float(),
        (g[:, other].double() * w[other].double() * x[:, other].double()).sum(-1).float(),
    ]

    def add_the_other_ranks(per_row):
        return per_row.add_(others.pop(0))

    def mine(x_mine, w_mine):
        return rms_norm(x_mine, w_mine, EPS, ARITHMETICS[name], width=48, reduce=add_the_other_ranks)

    got = value_and_grads(mine, x[:, :18], w[:18], g[:, :18])
    assert not others  # one sum each way
    whole = value_and_grads(formula, x, w, g)
    for what, a, b in zip(("y", "dx", "dw"), got, whole):
        assert_close(a, b[..., :18], torch.float32, what)


def test_a_split_width_without_a_sum_is_refused():
    x, w, _ = problem(torch.float32, torch.float32)
    with pytest.raises(ValueError, match="needs a `reduce`"):
        rms_norm(x, w, EPS, width=40)


def test_the_module_is_torchs_rmsnorm():
    x, w, g = problem(torch.float32, torch.float32)
    results = []
    for module in (RMSNorm(20, eps=EPS), torch.nn.RMSNorm(20, eps=EPS)):
        module = module.to(DEVICE)
        with torch.no_grad():
            module.weight.copy_(w)
        x_in = x.detach().requires_grad_()
        y = module(x_in)
        results.append([y, *torch.autograd.grad(y, (x_in, module.weight), g)])
    for what, a, b in zip(("y", "dx", "dw"), *results):
        torch.testing.assert_close(a, b, msg=what)
