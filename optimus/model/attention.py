"""Causal self-attention with RoPE, QK-norm (per head, whole projection or none) and grouped-query heads."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from optimus.config import ModelConfig, qk_norm_mode


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each [S, head_dim / 2], in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles_SH = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles_SH.cos(), angles_SH.sin()


def apply_rope(x_BNSH: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head dimension (the "rotate_half" convention)."""
    x1, x2 = x_BNSH.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos_SH - x2 * sin_SH, x2 * cos_SH + x1 * sin_SH), dim=-1)
    return out.to(x_BNSH.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.rope_theta = cfg.rope_theta
        kv_dim = self.n_kv_heads * self.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        # QK-norm: "full" normalises the whole q and k projections (OLMoE), "head" each head on its own
        # with weights shared by the heads (Qwen3), "none" leaves them alone (Mixtral).
        self.qk_norm = qk_norm_mode(cfg.qk_norm)
        q_norm_dim, k_norm_dim = (cfg.dim, kv_dim) if self.qk_norm == "full" else (self.head_dim, self.head_dim)
        has_norm = self.qk_norm != "none"
        self.q_norm = nn.RMSNorm(q_norm_dim, eps=cfg.norm_eps) if has_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(k_norm_dim, eps=cfg.norm_eps) if has_norm else nn.Identity()
        self._rope_cache: tuple[int, torch.device, torch.Tensor, torch.Tensor] | None = None

    def _rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self._rope_cache
        if cache is None or cache[0] < seq_len or cache[1] != device:
            cos, sin = rope_tables(seq_len, self.head_dim, self.rope_theta, device)
            cache = self._rope_cache = (seq_len, device, cos, sin)
        return cache[2][:seq_len], cache[3][:seq_len]

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q_BSD, k_BSK = self.wq(x_BSD), self.wk(x_BSD)  # K here = kv heads x head_dim
        v_BSK = self.wv(x_BSD)
        if self.qk_norm == "full":
            q_BSD, k_BSK = self.q_norm(q_BSD), self.k_norm(k_BSK)
        q_BSNH = q_BSD.view(B, S, self.n_heads, self.head_dim)
        k_BSNH = k_BSK.view(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q_BSNH, k_BSNH = self.q_norm(q_BSNH), self.k_norm(k_BSNH)
        q = q_BSNH.transpose(1, 2)  # [B, N, S, H]
        k = k_BSNH.transpose(1, 2)  # [B, Nkv, S, H]
        v = v_BSK.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self._rope(S, x_BSD.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(B, S, D))
