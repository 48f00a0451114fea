"""RoPE in each backend's rotation (optimus.kernels.rope) against the formula in fp64: values and the input's
gradient, for a transposed projection's strides, fp32 and bf16, and the output in another dtype.

Triton's kernel runs under the interpreter without a GPU (tests.kernels.test_kernels_triton sets it up); the
shapes are small and span several of the interpreter's tiles of rows.
"""

import pytest
import torch

from optimus.kernels import get_backend
from optimus.kernels.rope import apply_rope, torch_rotate
from optimus.model.attention import rope_tables

try:
    from tests.kernels.test_kernels_triton import DEVICE  # sets TRITON_INTERPRET without a GPU

    ROTATIONS = {"torch": torch_rotate, "triton": get_backend("triton").rope}
except pytest.skip.Exception:  # triton is not installed: the torch rotation alone
    DEVICE, ROTATIONS = "cpu", {"torch": torch_rotate}


def formula(x_BNSH, cos_SH, sin_SH):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in fp64."""
    x1, x2 = x_BNSH.double().chunk(2, dim=-1)
    cos, sin = cos_SH.double(), sin_SH.double()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def projection(dtype, B=2, S=5, N=3, H=8):
    """q as attention makes it: a [B, S, N, H] projection seen as [B, N, S, H] (not contiguous)."""
    gen = torch.Generator().manual_seed(7)
    x_BSNH = torch.randn(B, S, N, H, generator=gen).to(DEVICE, dtype)
    cos, sin = rope_tables(S, H, 10000.0, torch.device(DEVICE))
    return x_BSNH.transpose(1, 2), cos, sin, torch.randn(B, N, S, H, generator=gen).to(DEVICE)


@pytest.mark.parametrize("name", list(ROTATIONS))
@pytest.mark.parametrize(
    "dtype,out_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_matches_the_formula(name, dtype, out_dtype):
    x, cos, sin, g = projection(dtype)
    assert not x.is_contiguous()
    x = x.detach().requires_grad_()
    out = apply_rope(x, cos, sin, out_dtype, ROTATIONS[name])
    (dx,) = torch.autograd.grad(out, x, g.to(out_dtype))
    x64 = x.detach().double().requires_grad_()
    want = formula(x64, cos, sin)
    (want_dx,) = torch.autograd.grad(want, x64, g.double())
    assert (out.dtype, dx.dtype, out.is_contiguous()) == (out_dtype, dtype, True)
    for what, got, expected, dt in (("out", out, want, out_dtype), ("dx", dx, want_dx, dtype)):
        tol = 1e-6 if dt == torch.float32 else 8e-3  # one rounding of the fp32 result (of g's too, in bf16)
        err, scale = (got.double() - expected).abs().max().item(), expected.abs().max().item()
        assert err <= tol * scale, f"{name} {what}: max error {err:.3g} against {scale:.3g}"


def test_the_rotations_agree_where_they_round_once():
    """Both rotations compute in fp32 and round once to bf16: they agree to one bf16 unit at most."""
    if "triton" not in ROTATIONS:
        pytest.skip("triton is not installed")
    x, cos, sin, _ = projection(torch.bfloat16, B=1, S=9, N=2, H=16)
    a, b = (rotate(x, cos, sin, False, torch.bfloat16).double() for rotate in ROTATIONS.values())
    assert ((a - b).abs() <= a.abs() * 2**-7 + 1e-30).all()
