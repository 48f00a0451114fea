"""The Triton expert path: autograd.Functions over the kernels in `triton_kernels`.

Imported only when the triton backend is chosen (it imports triton). Everything runs in
the compute dtype (autocast dtype under autocast, else the input's dtype) with fp32
accumulation; weight gradients come back in the weights' own dtype.

Token <-> assignment maps: permute's backward and combine's forward sum, for each token, its
assignments. They walk the assignments sorted by token (a stable argsort, so the sum order
is fixed), so no atomics are needed and results are deterministic.
"""

import torch

from optimus.kernels import triton_kernels as tk
from optimus.kernels.counting import count_ids
from optimus.kernels.dtypes import compute_dtype


def _token_segments(token_idx_A: torch.Tensor, n_tokens: int):
    """(assignments sorted by token -> [A], cumulative end of each token's run -> [T], int32)."""
    order_A = torch.argsort(token_idx_A, stable=True)
    seg_end_T = torch.cumsum(count_ids(token_idx_A, n_tokens), 0)
    return order_A, seg_end_T.to(torch.int32)


def _check_rows(offsets_E: torch.Tensor, n_rows: int) -> None:
    if offsets_E.numel() and offsets_E.device.type == "cpu" and int(offsets_E[-1]) != n_rows:
        raise ValueError(f"offsets_E ends at {int(offsets_E[-1])} but x has {n_rows} rows; they must match.")


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, token_idx_A, dtype):
        ctx.save_for_backward(token_idx_A)
        ctx.n_tokens, ctx.x_dtype = x_TD.shape[0], x_TD.dtype
        return tk.gather_rows(x_TD.to(dtype), token_idx_A)  # [A, D]

    @staticmethod
    def backward(ctx, dy_AD):
        (token_idx_A,) = ctx.saved_tensors
        order_A, seg_end_T = _token_segments(token_idx_A, ctx.n_tokens)
        return tk.segment_sum(dy_AD, order_A, seg_end_T, None, ctx.x_dtype), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_AD, token_idx_A, weight_A, n_tokens, dtype):
        y_c = y_AD.to(dtype).contiguous()
        order_A, seg_end_T = _token_segments(token_idx_A, n_tokens)
        ctx.save_for_backward(y_c, token_idx_A, weight_A)
        ctx.y_dtype = y_AD.dtype
        return tk.segment_sum(y_c, order_A, seg_end_T, weight_A, dtype)  # [T, D]

    @staticmethod
    def backward(ctx, dout_TD):
        y_c, token_idx_A, weight_A = ctx.saved_tensors
        dy_AD, dw_A = tk.combine_backward(dout_TD, y_c, token_idx_A, weight_A, ctx.y_dtype, weight_A.dtype)
        return dy_AD, None, dw_A, None, None


class _SwiGLUExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_AD, w13_EDF2, w2_EFD, offsets_E, dtype):
        x_c, w13_c, w2_c = x_AD.to(dtype), w13_EDF2.to(dtype), w2_EFD.to(dtype)
        h13_AF2, h_AF = tk.swiglu_forward(x_c, w13_c, offsets_E)  # [A, 2F], [A, F]
        y_AD = tk.grouped_gemm(h_AF, w2_c, offsets_E)  # [A, D]
        ctx.save_for_backward(x_c, w13_c, w2_c, offsets_E, h13_AF2, h_AF)
        ctx.dtype, ctx.in_dtypes = dtype, (x_AD.dtype, w13_EDF2.dtype, w2_EFD.dtype)
        return y_AD

    @staticmethod
    def backward(ctx, dy_AD):
        x_c, w13_c, w2_c, offsets_E, h13_AF2, h_AF = ctx.saved_tensors
        dy_c = dy_AD.to(ctx.dtype)
        dh13_AF2 = tk.swiglu_backward(dy_c, w2_c, h13_AF2, offsets_E)  # [A, 2F]
        dx_AD = dw13 = dw2 = None
        if ctx.needs_input_grad[0]:
            dx_AD = tk.grouped_gemm(dh13_AF2, w13_c.transpose(1, 2), offsets_E).to(ctx.in_dtypes[0])
        if ctx.needs_input_grad[1]:
            dw13 = tk.grouped_wgrad(x_c, dh13_AF2, offsets_E, ctx.in_dtypes[1])  # [E, D, 2F]
        if ctx.needs_input_grad[2]:
            dw2 = tk.grouped_wgrad(h_AF, dy_c, offsets_E, ctx.in_dtypes[2])  # [E, F, D]
        return dx_AD, dw13, dw2, None, None


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_AK, w_EKN, offsets_E, dtype):
        x_c, w_c = x_AK.to(dtype), w_EKN.to(dtype)
        ctx.save_for_backward(x_c, w_c, offsets_E)
        ctx.dtype, ctx.in_dtypes = dtype, (x_AK.dtype, w_EKN.dtype)
        return tk.grouped_gemm(x_c, w_c, offsets_E)

    @staticmethod
    def backward(ctx, dy_AN):
        x_c, w_c, offsets_E = ctx.saved_tensors
        dy_c = dy_AN.to(ctx.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # input grad: dy @ w[e]^T, the forward kernel on a transposed view
            dx = tk.grouped_gemm(dy_c, w_c.transpose(1, 2), offsets_E).to(ctx.in_dtypes[0])
        if ctx.needs_input_grad[1]:
            dw = tk.grouped_wgrad(x_c, dy_c, offsets_E, ctx.in_dtypes[1])
        return dx, dw, None, None


def permute(x_TD: torch.Tensor, token_idx_A: torch.Tensor) -> torch.Tensor:
    """x_AD[a] = x_TD[token_idx_A[a]]."""
    return _Permute.apply(x_TD, token_idx_A, compute_dtype(x_TD))


def expert_swiglu_mlp(
    x_AD: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """Per-expert SwiGLU MLP over expert-sorted rows (see reference.expert_swiglu_mlp)."""
    _check_rows(offsets_E, x_AD.shape[0])
    return _SwiGLUExperts.apply(x_AD, w13_EDF2, w2_EFD, offsets_E.to(torch.int32), compute_dtype(x_AD))


def combine(y_AD: torch.Tensor, token_idx_A: torch.Tensor, weight_A: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """out[t] = sum over assignments a of token t of weight_A[a] * y_AD[a]."""
    return _Combine.apply(y_AD, token_idx_A, weight_A, n_tokens, compute_dtype(y_AD))


def grouped_mm(x_AK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Differentiable grouped GEMM: y[rows of e] = x[rows of e] @ w[e]."""
    _check_rows(offsets_E, x_AK.shape[0])
    return _GroupedMM.apply(x_AK, w_EKN, offsets_E.to(torch.int32), compute_dtype(x_AK))


def smoke_test() -> bool:
    """Compile and run one small grouped GEMM on the GPU; True when it matches torch."""
    device = "cuda" if torch.cuda.is_available() else "xpu"
    x = torch.randn(40, 32, device=device, dtype=torch.float16)
    w = torch.randn(2, 32, 48, device=device, dtype=torch.float16)
    offsets = torch.tensor([24, 40], device=device, dtype=torch.int32)
    y = tk.grouped_gemm(x, w, offsets)
    expect = torch.cat([x[:24] @ w[0], x[24:] @ w[1]])
    return bool(torch.allclose(y.float(), expect.float(), atol=1e-1, rtol=1e-2))
