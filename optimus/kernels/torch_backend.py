"""The plain-PyTorch expert path, tuned for CPUs (works on any device).

- permute / combine: `index_select` one way; the other way (a sum over each token's rows) is
  a CSR sparse x dense matmul on CPUs, `index_add_` elsewhere; no Python loop over tokens.
- expert MLP: one custom autograd.Function for the whole SwiGLU MLP; GEMMs are
  `torch._grouped_mm` (one call per GEMM for all experts, weight grads included) with a
  per-expert `torch.mm(out=)` loop when `_grouped_mm` is missing or strides are not 16-byte
  aligned. 16-bit GEMMs on a CPU run per expert on row counts from a small fixed set
  (`cached_rows`), so that oneDNN's kernels for them stay cached from step to step.
  Forward saves x, h13 = x @ W13, silu(gate) and h, so backward runs no recomputation
  and only three elementwise passes (one of them `silu_backward`).
- 16-bit compute on a CPU without 16-bit matmul units (see `dtypes.math_dtype`) rounds x,
  the weights and the incoming gradient to 16 bits and runs the GEMMs on fp32 copies:
  numerically 16-bit GEMMs with fp32 accumulation. The intermediates h13, h and dh13 stay
  fp32, as they would in a fused kernel's registers (a 16-bit GPU kernel rounds them).
"""

import functools
import warnings

import torch
import torch.nn.functional as F

from optimus.kernels.dtypes import compute_dtype, math_dtype, round_to

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _aligned(*tensors: torch.Tensor) -> bool:
    """`_grouped_mm` needs every non-unit stride and the base address 16-byte aligned."""
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        for size, stride in zip(t.shape, t.stride()):
            if size > 1 and stride != 1 and (stride * t.element_size()) % 16:
                return False
    return True


# On CPUs the per-expert mm loop measured faster than _grouped_mm with many small experts
# (benchmarks/moe_layer.py S2: 64 experts, ~1.9x) and level with it at 8 (S1).
_CPU_GROUPED_MAX_EXPERTS = 16


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # no fp64: gradient checks take the loop


def _use_grouped(n_experts: int, *tensors: torch.Tensor) -> bool:
    # CUDA's _grouped_mm only takes bf16; everywhere else fall back to the loop on doubt.
    if not _HAS_GROUPED_MM or tensors[0].dtype not in _GROUPED_MM_DTYPES or not _aligned(*tensors):
        return False
    if tensors[0].device.type == "cpu":
        return n_experts <= _CPU_GROUPED_MAX_EXPERTS
    return tensors[0].dtype == torch.bfloat16


# oneDNN, which runs PyTorch's 16-bit GEMMs on a CPU, builds (JIT-compiles) a kernel for every GEMM shape and
# caches it (1024 by default). An expert's row count changes every step, so exact-size GEMMs build new kernels
# every step: 8 experts of the default model, [~512, 256] x [256, 512] in bf16, ran at 152 GFLOP/s with new
# counts each call against 343 with repeated ones (2 cores, AVX512-BF16). Row counts rounded up to a sixteenth
# of their power of two (at most 6.25% more rows, 16 counts per octave) come from a set whose kernels stay
# cached: 310 GFLOP/s with new counts each call. fp32 goes to MKL, which builds nothing per shape.
_ROW_STEPS_PER_OCTAVE_LOG2 = 4


def _row_step(rows: int) -> int:
    """1/16 of the power of two at or below `rows` (1 below 32 rows)."""
    return 1 << max(0, rows.bit_length() - 1 - _ROW_STEPS_PER_OCTAVE_LOG2)


def cached_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of its `_row_step`: 16 row counts per octave, exact below 32 rows."""
    step = _row_step(rows)
    return -(-rows // step) * step


def _builds_kernel_per_shape(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def _grouped_mm_cached_rows(x_AK: torch.Tensor, w_EKN: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """grouped_mm with every GEMM on `cached_rows` rows: an expert's window runs past its own rows into the next
    expert's (their products are computed and dropped), so no row of x is copied or padded. Experts go in order
    and each writes its whole window: the next expert overwrites the rows it wrote beyond its own, and the last
    one's go to spare rows past the output's end. A window that would read past x's end takes the rows before
    its own instead, through a scratch output."""
    n_rows, pairs = x_AK.shape[0], list(zip(bounds[:-1], bounds[1:]))
    spare = max((cached_rows(hi - lo) - (hi - lo) for lo, hi in pairs if hi > lo), default=0)
    y_AN = x_AK.new_empty(n_rows + spare, w_EKN.shape[2])  # [A + spare, N]
    for e, (lo, hi) in enumerate(pairs):
        if hi == lo:
            continue
        rows = cached_rows(hi - lo)
        if rows > n_rows:  # fewer rows in all than the window: exact
            torch.mm(x_AK[lo:hi], w_EKN[e], out=y_AN[lo:hi])
        elif lo + rows <= n_rows:
            torch.mm(x_AK[lo : lo + rows], w_EKN[e], out=y_AN[lo : lo + rows])
        else:
            start = n_rows - rows
            y_AN[lo:hi] = torch.mm(x_AK[start:], w_EKN[e])[lo - start : hi - start]
    return y_AN[:n_rows]


def _grouped_wgrad_cached_rows(x_AK: torch.Tensor, g_AN: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """grouped_wgrad with every GEMM on a cached row count: rows are the reduction here, so a window may not
    borrow other experts' rows (they would add to the sum). Each expert's rows split into the largest cached
    count at or below them and a tail, zero-padded to one `_row_step`, whose product is added."""
    x_KA = x_AK.t()
    dw_EKN = x_AK.new_empty(len(bounds) - 1, x_AK.shape[1], g_AN.shape[1])  # [E, K, N]
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi == lo:
            dw_EKN[e].zero_()
            continue
        step = _row_step(hi - lo)
        tail = (hi - lo) % step  # `hi - lo - tail` is a cached count
        torch.mm(x_KA[:, lo : hi - tail], g_AN[lo : hi - tail], out=dw_EKN[e])
        if tail:
            x_tail_PK = x_AK.new_zeros(step, x_AK.shape[1])
            g_tail_PN = g_AN.new_zeros(step, g_AN.shape[1])
            x_tail_PK[:tail].copy_(x_AK[hi - tail : hi])
            g_tail_PN[:tail].copy_(g_AN[hi - tail : hi])
            dw_EKN[e].addmm_(x_tail_PK.t(), g_tail_PN)
    return dw_EKN


def grouped_mm(x_AK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e]  -> [A, N]. `bounds` = [0] + offsets as Python ints."""
    if _builds_kernel_per_shape(x_AK):
        return _grouped_mm_cached_rows(x_AK, w_EKN, bounds)
    if _use_grouped(w_EKN.shape[0], x_AK, w_EKN):
        return torch._grouped_mm(x_AK, w_EKN, offsets_E)
    y_AN = x_AK.new_empty(x_AK.shape[0], w_EKN.shape[2])
    for e in range(w_EKN.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.mm(x_AK[lo:hi], w_EKN[e], out=y_AN[lo:hi])
    return y_AN


def grouped_wgrad(x_AK: torch.Tensor, g_AN: torch.Tensor, offsets_E: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """dw[e] = x[rows of e]^T @ g[rows of e]  -> [E, K, N]; zero for experts without rows."""
    if _builds_kernel_per_shape(x_AK):
        return _grouped_wgrad_cached_rows(x_AK, g_AN, bounds)
    x_KA = x_AK.t()
    if _use_grouped(offsets_E.shape[0], x_KA, g_AN):
        return torch._grouped_mm(x_KA, g_AN, offsets_E)
    n_experts = offsets_E.shape[0]
    dw_EKN = x_AK.new_empty(n_experts, x_AK.shape[1], g_AN.shape[1])
    for e in range(n_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.mm(x_KA[:, lo:hi], g_AN[lo:hi], out=dw_EKN[e])
        else:
            dw_EKN[e].zero_()
    return dw_EKN


def _bounds(offsets_E: torch.Tensor) -> list[int]:
    return [0] + offsets_E.tolist()


def _no_autocast(device_type: str):
    # The Functions pick their own dtypes; autocast must not re-cast the GEMMs inside them.
    return torch.autocast(device_type, enabled=False)


def _backward_without_autocast(backward):
    """Backward may run inside the caller's autocast region (CPU runs it on the calling thread)."""

    @functools.wraps(backward)
    def wrapped(ctx, grad):
        with _no_autocast(grad.device.type):
            return backward(ctx, grad)

    return wrapped


def _scatter_sum(src_AD: torch.Tensor, token_idx_A: torch.Tensor, weight_A, n_tokens: int) -> torch.Tensor:
    """out[t] = sum over a with token_idx_A[a] == t of weight_A[a] * src_AD[a] -> [T, D] (weight None = 1).

    On CPUs a [T, A] CSR matrix times src (MKL sparse, multi-threaded) is several times faster
    than `index_add_`, which runs serially there; elsewhere `index_add_` is the fast one.
    """
    if src_AD.device.type == "cpu" and src_AD.dtype in (torch.float32, torch.float64) and src_AD.shape[0]:
        order_A = torch.argsort(token_idx_A, stable=True)
        crow = torch.zeros(n_tokens + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(token_idx_A, minlength=n_tokens), 0, out=crow[1:])
        values = src_AD.new_ones(order_A.shape[0]) if weight_A is None else weight_A.to(src_AD.dtype)[order_A]
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            shape = (n_tokens, src_AD.shape[0])
            matrix_TA = torch.sparse_csr_tensor(crow, order_A, values, shape, check_invariants=False)
        return torch.sparse.mm(matrix_TA, src_AD)
    if weight_A is not None:
        src_AD = src_AD * weight_A.to(src_AD.dtype).unsqueeze(1)
    return src_AD.new_zeros(n_tokens, src_AD.shape[1]).index_add_(0, token_idx_A, src_AD)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, token_idx_A, dtype):
        ctx.save_for_backward(token_idx_A)
        ctx.n_tokens, ctx.x_dtype = x_TD.shape[0], x_TD.dtype
        return x_TD.to(dtype).index_select(0, token_idx_A)  # [A, D]

    @staticmethod
    @_backward_without_autocast
    def backward(ctx, dy_AD):
        (token_idx_A,) = ctx.saved_tensors
        # Accumulate the K copies of each token in at least fp32.
        acc = torch.promote_types(dy_AD.dtype, torch.float32)
        dx_TD = _scatter_sum(dy_AD.to(acc), token_idx_A, None, ctx.n_tokens)
        return dx_TD.to(ctx.x_dtype), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_AD, token_idx_A, weight_A, n_tokens, dtype):
        acc = torch.promote_types(dtype, torch.float32)
        y_c = y_AD.to(dtype)
        w_c = weight_A.to(dtype)
        ctx.save_for_backward(y_c, token_idx_A, w_c)
        ctx.y_dtype, ctx.w_dtype = y_AD.dtype, weight_A.dtype
        return _scatter_sum(y_c.to(acc), token_idx_A, w_c.to(acc), n_tokens).to(dtype)  # [T, D]

    @staticmethod
    @_backward_without_autocast
    def backward(ctx, dout_TD):
        y_c, token_idx_A, w_c = ctx.saved_tensors
        acc = torch.promote_types(y_c.dtype, torch.float32)
        g_AD = dout_TD.to(acc).index_select(0, token_idx_A)  # [A, D]
        dy_AD = dw_A = None
        if ctx.needs_input_grad[2]:
            dw_A = torch.linalg.vecdot(g_AD, y_c.to(acc)).to(ctx.w_dtype)
        if ctx.needs_input_grad[0]:
            dy_AD = g_AD.mul_(w_c.to(acc).unsqueeze(1)).to(ctx.y_dtype)
        return dy_AD, None, dw_A, None, None


class _SwiGLUExperts(torch.autograd.Function):
    """y = (silu(x @ W1) * (x @ W3)) @ W2 per expert, with a hand-written backward."""

    @staticmethod
    def forward(ctx, x_AD, w13_EDF2, w2_EFD, offsets_E, dtype):
        math = math_dtype(dtype, x_AD.device)
        n_ffn = w2_EFD.shape[1]
        bounds = _bounds(offsets_E)
        x_m = round_to(x_AD, dtype, math)
        w13_m = round_to(w13_EDF2, dtype, math)
        w2_m = round_to(w2_EFD, dtype, math)
        h13_AF2 = grouped_mm(x_m, w13_m, offsets_E, bounds)  # [A, 2F]
        silu_AF = F.silu(h13_AF2[:, :n_ffn])  # [A, F], kept: backward needs it twice
        h_AF = silu_AF.mul(h13_AF2[:, n_ffn:])  # [A, F]
        y_AD = grouped_mm(h_AF, w2_m, offsets_E, bounds)  # [A, D]
        ctx.save_for_backward(x_m, w13_m, w2_m, offsets_E, h13_AF2, silu_AF, h_AF)
        ctx.bounds, ctx.dtype, ctx.math = bounds, dtype, math
        ctx.in_dtypes = (x_AD.dtype, w13_EDF2.dtype, w2_EFD.dtype)
        return y_AD.to(dtype)

    @staticmethod
    @_backward_without_autocast
    def backward(ctx, dy_AD):
        x_m, w13_m, w2_m, offsets_E, h13_AF2, silu_AF, h_AF = ctx.saved_tensors
        bounds, dtype, math = ctx.bounds, ctx.dtype, ctx.math
        n_ffn = w2_m.shape[1]
        # _grouped_mm's own backward rejects stride-0 grads; ours needs dense rows too.
        dy_m = round_to(dy_AD, dtype, math).contiguous()
        dh_AF = grouped_mm(dy_m, w2_m.transpose(1, 2), offsets_E, bounds)  # [A, F]
        dw2_EFD = grouped_wgrad(h_AF, dy_m, offsets_E, bounds) if ctx.needs_input_grad[2] else None
        gate_AF, up_AF = h13_AF2[:, :n_ffn], h13_AF2[:, n_ffn:]
        dh13_AF2 = torch.empty_like(h13_AF2)  # [A, 2F] = [d gate | d up]
        torch.mul(dh_AF, silu_AF, out=dh13_AF2[:, n_ffn:])
        torch.mul(dh_AF, up_AF, out=dh_AF)
        torch.ops.aten.silu_backward.grad_input(dh_AF, gate_AF, grad_input=dh13_AF2[:, :n_ffn])
        dx_AD = dw13_EDF2 = None
        if ctx.needs_input_grad[0]:
            dx_AD = grouped_mm(dh13_AF2, w13_m.transpose(1, 2), offsets_E, bounds).to(ctx.in_dtypes[0])
        if ctx.needs_input_grad[1]:
            dw13_EDF2 = grouped_wgrad(x_m, dh13_AF2, offsets_E, bounds).to(ctx.in_dtypes[1])
        if dw2_EFD is not None:
            dw2_EFD = dw2_EFD.to(ctx.in_dtypes[2])
        return dx_AD, dw13_EDF2, dw2_EFD, None, None


def permute(x_TD: torch.Tensor, token_idx_A: torch.Tensor) -> torch.Tensor:
    """x_AD[a] = x_TD[token_idx_A[a]]."""
    dtype = compute_dtype(x_TD)
    with _no_autocast(x_TD.device.type):
        return _Permute.apply(x_TD, token_idx_A, dtype)


def expert_swiglu_mlp(
    x_AD: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """Per-expert SwiGLU MLP over expert-sorted rows (see reference.expert_swiglu_mlp)."""
    dtype = compute_dtype(x_AD)
    with _no_autocast(x_AD.device.type):
        return _SwiGLUExperts.apply(x_AD, w13_EDF2, w2_EFD, offsets_E.to(torch.int32), dtype)


def combine(y_AD: torch.Tensor, token_idx_A: torch.Tensor, weight_A: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """out[t] = sum over assignments a of token t of weight_A[a] * y_AD[a]."""
    dtype = compute_dtype(y_AD)
    with _no_autocast(y_AD.device.type):
        return _Combine.apply(y_AD, token_idx_A, weight_A, n_tokens, dtype)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_AK, w_EKN, offsets_E, dtype):
        math = math_dtype(dtype, x_AK.device)
        bounds = _bounds(offsets_E)
        x_m, w_m = round_to(x_AK, dtype, math), round_to(w_EKN, dtype, math)
        ctx.save_for_backward(x_m, w_m, offsets_E)
        ctx.bounds, ctx.dtype, ctx.math, ctx.in_dtypes = bounds, dtype, math, (x_AK.dtype, w_EKN.dtype)
        return grouped_mm(x_m, w_m, offsets_E, bounds).to(dtype)

    @staticmethod
    @_backward_without_autocast
    def backward(ctx, dy_AN):
        x_m, w_m, offsets_E = ctx.saved_tensors
        dy_m = round_to(dy_AN, ctx.dtype, ctx.math).contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm(dy_m, w_m.transpose(1, 2), offsets_E, ctx.bounds).to(ctx.in_dtypes[0])
        if ctx.needs_input_grad[1]:
            dw = grouped_wgrad(x_m, dy_m, offsets_E, ctx.bounds).to(ctx.in_dtypes[1])
        return dx, dw, None, None


def grouped_mm_op(x_AK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Differentiable grouped GEMM: y[rows of e] = x[rows of e] @ w[e]."""
    dtype = compute_dtype(x_AK)
    with _no_autocast(x_AK.device.type):
        return _GroupedMM.apply(x_AK, w_EKN, offsets_E.to(torch.int32), dtype)
