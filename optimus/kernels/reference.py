"""Plain-PyTorch reference for the expert path, RMSNorm and RoPE: the oracle the fast kernels are tested against.

Shapes: T tokens, A routed assignments (T*K when nothing is dropped), D model dim,
F expert hidden dim, E experts. `offsets_E` holds the cumulative end row of each
expert's rows in the expert-sorted assignment order (int32, last entry == A).
"""

import torch
import torch.nn.functional as F


def permute(x_TD: torch.Tensor, token_idx_A: torch.Tensor) -> torch.Tensor:
    """Rows of x in assignment order: x_AD[a] = x_TD[token_idx_A[a]]."""
    return x_TD[token_idx_A]


def expert_swiglu_mlp(
    x_AD: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """y[rows of e] = (silu(x @ W1[e]) * (x @ W3[e])) @ W2[e], one matmul per expert."""
    n_ffn = w2_EFD.shape[1]
    y_AD = x_AD.new_zeros(x_AD.shape[0], w2_EFD.shape[2])
    start = 0
    # unbind, not w[e]: each w[e]'s backward would zero-fill a gradient of the whole stack, once per expert
    for end, w13_DF2, w2_FD in zip(offsets_E.tolist(), w13_EDF2.unbind(0), w2_EFD.unbind(0)):
        if end > start:
            h_F2 = x_AD[start:end] @ w13_DF2
            h_F = F.silu(h_F2[:, :n_ffn]) * h_F2[:, n_ffn:]
            y_AD[start:end] = h_F @ w2_FD
        start = end
    return y_AD


def combine(y_AD: torch.Tensor, token_idx_A: torch.Tensor, weight_A: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """out[t] = sum over assignments a of token t of weight_A[a] * y_AD[a]."""
    out_TD = y_AD.new_zeros(n_tokens, y_AD.shape[1])
    return out_TD.index_add(0, token_idx_A, y_AD * weight_A.unsqueeze(1).to(y_AD.dtype))


def grouped_mm(x_AK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e], one matmul per expert."""
    y_AN = x_AK.new_zeros(x_AK.shape[0], w_EKN.shape[2])
    start = 0
    for end, w_KN in zip(offsets_E.tolist(), w_EKN.unbind(0)):  # unbind: see expert_swiglu_mlp
        if end > start:
            y_AN[start:end] = x_AK[start:end] @ w_KN
        start = end
    return y_AN


def rms_norm(x_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean of x^2 over the last dimension + eps) * w (in x's and w's promoted dtype)."""
    return x_TD * torch.rsqrt(x_TD.square().mean(-1, keepdim=True) + eps) * w_D


def rope(x_BNSH: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
    """(x1 cos - x2 sin, x2 cos + x1 sin) over the halves x1, x2 of the last dimension."""
    x1, x2 = x_BNSH.chunk(2, dim=-1)
    return torch.cat((x1 * cos_SH - x2 * sin_SH, x2 * cos_SH + x1 * sin_SH), dim=-1)


def random_routing(
    n_tokens: int, n_experts: int, top_k: int, generator: torch.Generator, empty_experts: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform random top-k routing in expert-sorted order, for tests and benchmarks.

    Each token picks `top_k` distinct experts (never one in `empty_experts`). Returns
    (token_idx_A int64, weight_A fp32 in (0, 1), offsets_E int32 cumulative row ends).
    """
    if top_k > n_experts - len(empty_experts):
        raise ValueError(
            f"top_k={top_k} needs at least that many experts with rows, not {n_experts - len(empty_experts)}."
        )
    scores_TE = torch.rand(n_tokens, n_experts, generator=generator)
    if empty_experts:
        scores_TE[:, list(empty_experts)] = -1.0
    expert_TK = scores_TE.topk(top_k, dim=1).indices  # [T, K]
    expert_A = expert_TK.reshape(-1)
    order_A = torch.argsort(expert_A, stable=True)
    token_idx_A = order_A // top_k
    weight_A = torch.rand(expert_A.shape[0], generator=generator) * 0.9 + 0.05
    offsets_E = torch.cumsum(torch.bincount(expert_A, minlength=n_experts), 0).to(torch.int32)
    return token_idx_A, weight_A, offsets_E
