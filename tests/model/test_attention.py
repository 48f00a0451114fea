"""Attention (RoPE with its written-out backward, SDPA in fp32 for small heads on CPU) against plain formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from optimus.kernels.rope import apply_rope
from optimus.model.attention import Attention, rope_tables
from tests.model.test_loss import assert_relative_error
from tests.model.test_model import tiny_config


def rope_formula(x_BNSH, cos_SH, sin_SH):
    x1, x2 = x_BNSH.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos_SH - x2 * sin_SH, x2 * cos_SH + x1 * sin_SH), dim=-1)


def attention_formula(attn: Attention, x_BSD: torch.Tensor) -> torch.Tensor:
    """Softmax(q k^T / sqrt(H) + causal mask) v with every step spelled out, in fp32."""
    B, S, D = x_BSD.shape
    N, Nkv, H = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = F.linear(x_BSD, attn.wq.weight), F.linear(x_BSD, attn.wk.weight), F.linear(x_BSD, attn.wv.weight)
    if attn.qk_norm == "full":
        q = F.rms_norm(q, (D,), attn.q_norm.weight, attn.q_norm.eps)
        k = F.rms_norm(k, (Nkv * H,), attn.k_norm.weight, attn.k_norm.eps)
    q, k, v = q.view(B, S, N, H), k.view(B, S, Nkv, H), v.view(B, S, Nkv, H)
    if attn.qk_norm == "head":
        q = F.rms_norm(q, (H,), attn.q_norm.weight, attn.q_norm.eps)
        k = F.rms_norm(k, (H,), attn.k_norm.weight, attn.k_norm.eps)
    cos, sin = rope_tables(S, H, attn.rope_theta, x_BSD.device)
    q, k = rope_formula(q.transpose(1, 2), cos, sin), rope_formula(k.transpose(1, 2), cos, sin)
    k, v = k.repeat_interleave(N // Nkv, dim=1), v.transpose(1, 2).repeat_interleave(N // Nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(H)
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    out = scores.softmax(-1) @ v  # [B, N, S, H]
    return F.linear(out.transpose(1, 2).reshape(B, S, D), attn.wo.weight)


def test_rope_and_its_gradient_match_the_formula():
    cos, sin = rope_tables(12, 8, 10000.0, torch.device("cpu"))
    x = torch.randn(2, 3, 12, 8, requires_grad=True)
    grad = torch.randn(2, 3, 12, 8)
    out, expected = apply_rope(x, cos, sin), rope_formula(x, cos, sin)
    assert_relative_error(out, expected)
    assert_relative_error(*(torch.autograd.grad(y, x, grad)[0] for y in (out, expected)))
    assert apply_rope(x.bfloat16(), cos, sin).dtype == torch.bfloat16
    assert apply_rope(x.bfloat16(), cos, sin, torch.float32).dtype == torch.float32


def make_attention(qk_norm: str, dim: int = 32, n_heads: int = 4) -> tuple[Attention, torch.Tensor]:
    torch.manual_seed(0)
    attn = Attention(tiny_config(qk_norm=qk_norm, dim=dim, n_heads=n_heads, n_kv_heads=n_heads // 2))
    for p in attn.parameters():  # norm weights away from 1, so that a wrong norm weight shows
        torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.3 if p.ndim == 1 else 0.2)
    return attn, torch.randn(2, 10, dim, requires_grad=True)


@pytest.mark.parametrize("qk_norm", ["full", "head", "none"])
def test_fp32_attention_and_gradients_match_the_formula(qk_norm):
    attn, x = make_attention(qk_norm)
    out, expected = attn(x), attention_formula(attn, x)
    assert_relative_error(out, expected)
    params = [x, *attn.parameters()]
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(expected, params, grad)):
        assert_relative_error(a, b)


@pytest.mark.parametrize("dim,n_heads", [(32, 4), (256, 2)])  # head_dim 8: fp32 SDPA on CPU; 128: bf16 SDPA
def test_bf16_attention_under_autocast_is_close_to_fp32(dim, n_heads):
    attn, x = make_attention("full", dim, n_heads)
    expected = attention_formula(attn, x)
    attn_bf16 = attn.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn_bf16(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert_relative_error(out, expected, tol=3e-2)  # bf16 projections round at 2^-8
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in attn_bf16.parameters())
