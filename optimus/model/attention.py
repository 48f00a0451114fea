"""Causal self-attention with RoPE, QK-norm (per head, whole projection or none) and grouped-query heads."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from optimus.config import ModelConfig, qk_norm_mode
from optimus.kernels.rms_norm import TORCH_NORM, NormArithmetic
from optimus.kernels.rope import Rotate, apply_rope, torch_rotate
from optimus.model.norm import RMSNorm


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each [S, head_dim / 2], in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles_SH = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles_SH.cos(), angles_SH.sin()


# On a CPU, SDPA's flash kernel is faster in fp32 than in bf16 for small heads: its bf16 path converts
# every block to fp32 and its bf16 GEMMs gain nothing at a 32-wide reduction. fwd + bwd, one core of an
# AVX512-BF16 EPYC, bf16 time / fp32 time: 1.49 at head_dim 32 (S 256), 1.07 at 128 (S 256), 0.92 at
# 64 (S 1024), 0.82 at 128 (S 2048). Heads up to this size attend in fp32 there (values: as fp32 is).
CPU_FP32_ATTENTION_MAX_HEAD_DIM = 32


def attention_dtype(device_type: str, head_dim: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype SDPA runs in for projections in `dtype` on a `device_type` device: fp32 for small heads on a CPU
    (CPU_FP32_ATTENTION_MAX_HEAD_DIM), else `dtype`. The memory planner (optimus.plan) asks it too: q, k, v and
    the output are then kept in fp32."""
    if device_type == "cpu" and head_dim <= CPU_FP32_ATTENTION_MAX_HEAD_DIM:
        return torch.float32
    return dtype


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_arithmetic: NormArithmetic = TORCH_NORM, rotate: Rotate = torch_rotate):
        super().__init__()
        self.rotate = rotate  # the kernel backend's RoPE (optimus.kernels.rope)
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
        self.q_norm = RMSNorm(q_norm_dim, cfg.norm_eps, norm_arithmetic) if has_norm else nn.Identity()
        self.k_norm = RMSNorm(k_norm_dim, cfg.norm_eps, norm_arithmetic) if has_norm else nn.Identity()
        self._rope_cache: tuple[int, torch.device, torch.Tensor, torch.Tensor] | None = None

    def _rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self._rope_cache
        if cache is None or cache[0] < seq_len or cache[1] != device:
            cos, sin = rope_tables(seq_len, self.head_dim, self.rope_theta, device)
            cache = self._rope_cache = (seq_len, device, cos, sin)
        return cache[2][:seq_len], cache[3][:seq_len]

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q_BSD, k_BSK = self.wq(x_BSD), self.wk(x_BSD)  # K here = kv heads x head_dim
        v_BSK = self.wv(x_BSD)
        if self.qk_norm == "full":
            q_BSD, k_BSK = self.q_norm(q_BSD), self.k_norm(k_BSK)
        # -1 heads: under tensor parallelism a rank holds n_heads / tp of them (optimus.parallel.tensor_parallel).
        q_BSNH = q_BSD.view(B, S, -1, self.head_dim)
        k_BSNH = k_BSK.view(B, S, -1, self.head_dim)
        if self.qk_norm == "head":
            q_BSNH, k_BSNH = self.q_norm(q_BSNH), self.k_norm(k_BSNH)
        q = q_BSNH.transpose(1, 2)  # [B, N, S, H]
        k = k_BSNH.transpose(1, 2)  # [B, Nkv, S, H]
        v = v_BSK.view(B, S, -1, self.head_dim).transpose(1, 2)
        cos, sin = self._rope(S, x_BSD.device)
        dtype = attention_dtype(v.device.type, self.head_dim, v.dtype)
        q, k = apply_rope(q, cos, sin, dtype, self.rotate), apply_rope(k, cos, sin, dtype, self.rotate)
        with torch.autocast(x_BSD.device.type, enabled=False):  # SDPA in `dtype`, whatever autocast says
            out = F.scaled_dot_product_attention(
                q, k, v.to(dtype), is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
            )
        # [B, N, S, H] -> [B, S, N, H] in the projections' dtype, in one pass (cast and transpose together)
        out_BSNH = out.transpose(1, 2).to(v.dtype, memory_format=torch.contiguous_format)
        return self.wo(out_BSNH.reshape(B, S, -1))
