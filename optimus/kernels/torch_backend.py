"""The plain-PyTorch expert path: the portable schedule, and the choice of the CPU's own (`cpu_schedules`).

- permute / combine: `index_select` one way; the other way (a sum over each token's rows) is `index_add_`, or
  on CPUs a CSR sparse x dense matmul (`cpu_schedules.csr_scatter_sum`); no Python loop over tokens.
  16-bit rows are widened to fp32 a block at a time, in cache.
- expert MLP: one custom autograd.Function for the whole SwiGLU MLP. Portable schedule: each GEMM over all
  experts, `torch.nn.functional.grouped_mm` (one call per GEMM, weight grads included; through
  `torch_private`), with a per-expert `torch.mm(out=)` loop where grouped_mm is missing or strides are not
  16-byte aligned. 16-bit GEMMs on a CPU take `cpu_schedules` instead: per expert on row counts from a small
  fixed set (oneDNN's kernels stay cached from step to step), the MLP one expert at a time, or, for small
  experts with even loads, as batched GEMMs over every expert's rows padded to one count.
  Forward saves x, h13 = x @ W13, silu(gate) and h, so backward runs no recomputation
  and only three elementwise passes (one of them `silu_backward`).
- 16-bit compute on a CPU without 16-bit matmul units (see `dtypes.math_dtype`) rounds x,
  the weights and the incoming gradient to 16 bits and runs the GEMMs on fp32 copies:
  numerically 16-bit GEMMs with fp32 accumulation. The intermediates h13, h and dh13 stay
  fp32, as they would in a fused kernel's registers (a 16-bit GPU kernel rounds them).
"""

import functools

import torch

from optimus.kernels import cpu_schedules as cpu
from optimus.kernels.dtypes import compute_dtype, math_dtype, on_cpu, round_to
from optimus.kernels.host_reads import RowReads, assumed_bounds, group_bounds
from optimus.kernels.swiglu import swiglu, swiglu_backward
from optimus.kernels.torch_private import FakeTensor, needed_input_grads
from optimus.kernels.torch_private import grouped_mm as torch_grouped_mm

_HAS_GROUPED_MM = torch_grouped_mm is not None


def _address(t: torch.Tensor) -> int:
    """t's address; for a fake tensor, which has no memory, its offset into a storage that starts 16-byte aligned
    (as every allocator's does)."""
    return t.storage_offset() * t.element_size() if isinstance(t, FakeTensor) else t.data_ptr()


def _aligned(*tensors: torch.Tensor) -> bool:
    """torch's grouped GEMM needs every non-unit stride and the base address 16-byte aligned."""
    for t in tensors:
        if _address(t) % 16:
            return False
        for size, stride in zip(t.shape, t.stride()):
            if size > 1 and stride != 1 and (stride * t.element_size()) % 16:
                return False
    return True


# On CPUs the per-expert mm loop measured faster than the grouped GEMM with many small experts
# (benchmarks/moe_layer.py S2: 64 experts, ~1.9x) and level with it at 8 (S1).
_CPU_GROUPED_MAX_EXPERTS = 16


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # no fp64: gradient checks take the loop


def _use_grouped(n_experts: int, *tensors: torch.Tensor) -> bool:
    # CUDA's grouped GEMM only takes bf16; everywhere else fall back to the loop on doubt.
    if not _HAS_GROUPED_MM or tensors[0].dtype not in _GROUPED_MM_DTYPES or not _aligned(*tensors):
        return False
    if on_cpu(tensors[0]):
        return n_experts <= _CPU_GROUPED_MAX_EXPERTS
    return tensors[0].dtype == torch.bfloat16


def _builds_kernel_per_shape(t: torch.Tensor) -> bool:
    """16-bit on a CPU, where oneDNN builds a GEMM kernel per shape: the GEMMs take `cpu_schedules`."""
    return on_cpu(t) and t.dtype in (torch.bfloat16, torch.float16)


class RowBounds:
    """Each expert's rows: `offsets_E` (int32 [E], the end row of each expert, `n_rows` in all) where they live,
    and `ints`, [0] + offsets as host integers, read back only when first asked for.

    Reading them is a host synchronisation on a GPU (the launch queue drains while the host waits), so only
    the per-expert loops ask, which slice rows by host integers: the CPU's paths, and a GPU's where
    grouped_mm cannot run (`_use_grouped`). grouped_mm takes the offsets where they are. `reads`: a dry run's
    answers (optimus.kernels.host_reads), None in a real step.
    """

    def __init__(self, offsets_E: torch.Tensor, n_rows: int, reads: RowReads | None = None):
        self.offsets_E, self.n_rows, self.reads = offsets_E, n_rows, reads

    @functools.cached_property
    def ints(self) -> list[int]:
        return group_bounds(self.offsets_E, self.n_rows, self.reads)

    def assumed_ints(self) -> list[int]:
        """The bounds a dry run's load model implies, without a read (fake tensors only)."""
        return assumed_bounds(self.n_rows, self.offsets_E.shape[0], self.reads)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, bounds: RowBounds) -> torch.Tensor:
    """torch's grouped GEMM (`torch_private.grouped_mm`): [A, K] x [E, K, N] -> [A, N], or [K, A] x [A, N] ->
    [E, K, N]. Fake tensors (a dry run) run its meta kernel, which refuses all but bf16 (the CUDA kernel's rule)
    where the CPU kernel takes fp32 and fp16 too: for those the dry run issues the products the CPU kernel runs,
    one group at a time, at the load model's rows (and, as the kernel, reads nothing back)."""
    if isinstance(a, FakeTensor) and a.dtype != torch.bfloat16:
        if b.dim() == 3:
            return _mm_loop(a, b, bounds.assumed_ints())
        return _wgrad_loop(a.t(), b, bounds.assumed_ints(), bounds.offsets_E.shape[0])
    return torch_grouped_mm(a, b, offs=bounds.offsets_E)


def _mm_loop(x_AK: torch.Tensor, w_EKN: torch.Tensor, ints: list[int]) -> torch.Tensor:
    y_AN = x_AK.new_empty(x_AK.shape[0], w_EKN.shape[2])
    for e in range(w_EKN.shape[0]):
        lo, hi = ints[e], ints[e + 1]
        if hi > lo:
            torch.mm(x_AK[lo:hi], w_EKN[e], out=y_AN[lo:hi])
    return y_AN


def _wgrad_loop(x_AK: torch.Tensor, g_AN: torch.Tensor, ints: list[int], n_experts: int) -> torch.Tensor:
    x_KA = x_AK.t()
    dw_EKN = x_AK.new_empty(n_experts, x_AK.shape[1], g_AN.shape[1])
    for e in range(n_experts):
        lo, hi = ints[e], ints[e + 1]
        if hi > lo:
            torch.mm(x_KA[:, lo:hi], g_AN[lo:hi], out=dw_EKN[e])
        else:
            dw_EKN[e].zero_()
    return dw_EKN


def grouped_mm(x_AK: torch.Tensor, w_EKN: torch.Tensor, bounds: RowBounds) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e]  -> [A, N]."""
    if _builds_kernel_per_shape(x_AK):
        return cpu.grouped_mm_cached_rows(x_AK, w_EKN, bounds.ints)
    if _use_grouped(w_EKN.shape[0], x_AK, w_EKN):
        return _grouped_mm(x_AK, w_EKN, bounds)
    return _mm_loop(x_AK, w_EKN, bounds.ints)


def grouped_wgrad(x_AK: torch.Tensor, g_AN: torch.Tensor, bounds: RowBounds) -> torch.Tensor:
    """dw[e] = x[rows of e]^T @ g[rows of e]  -> [E, K, N]; zero for experts without rows."""
    if _builds_kernel_per_shape(x_AK):
        return cpu.grouped_wgrad_cached_rows(x_AK, g_AN, bounds.ints)
    x_KA = x_AK.t()
    n_experts = bounds.offsets_E.shape[0]
    if _use_grouped(n_experts, x_KA, g_AN):
        return _grouped_mm(x_KA, g_AN, bounds)
    return _wgrad_loop(x_AK, g_AN, bounds.ints, n_experts)


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


def _scatter_sum(src_AD: torch.Tensor, token_idx_A: torch.Tensor, weight_A, n_tokens: int, acc) -> torch.Tensor:
    """out[t] = sum over a with token_idx_A[a] == t of weight_A[a] * src_AD[a] -> [T, D] in `acc`, summed in `acc`
    (weight None = 1).

    On CPUs a [T, A] CSR matrix times src (MKL sparse, multi-threaded) is several times faster
    than `index_add_`, which runs serially there; elsewhere `index_add_` is the fast one.
    """
    # Sparse CSR tensors do not run on fake tensors: a dry run (optimus plan --dry-run) takes index_add here.
    csr = on_cpu(src_AD) and not isinstance(src_AD, FakeTensor)
    if csr and acc in (torch.float32, torch.float64) and src_AD.shape[0]:
        return cpu.csr_scatter_sum(src_AD, token_idx_A, weight_A, n_tokens, acc)
    src_AD = src_AD.to(acc)
    if weight_A is not None:
        src_AD = src_AD * weight_A.to(acc).unsqueeze(1)
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
        dx_TD = _scatter_sum(dy_AD, token_idx_A, None, ctx.n_tokens, acc)
        return dx_TD.to(ctx.x_dtype), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_AD, token_idx_A, weight_A, n_tokens, dtype):
        acc = torch.promote_types(dtype, torch.float32)
        y_c = y_AD.to(dtype)
        w_c = weight_A.to(dtype)
        ctx.save_for_backward(y_c, token_idx_A, w_c)
        ctx.y_dtype, ctx.w_dtype = y_AD.dtype, weight_A.dtype
        return _scatter_sum(y_c, token_idx_A, w_c, n_tokens, acc).to(dtype)  # [T, D]

    @staticmethod
    @_backward_without_autocast
    def backward(ctx, dout_TD):
        y_c, token_idx_A, w_c = ctx.saved_tensors
        acc = torch.promote_types(y_c.dtype, torch.float32)
        # dy = dout x weight is one product: of two 16-bit floats it is exact in fp32, so multiplying them in their
        # own dtype (fp32 inside, one rounding) gives what widening them first does, without the widened copies.
        narrow = dout_TD.dtype == w_c.dtype == ctx.y_dtype
        dout_TD, w_A = (dout_TD, w_c) if narrow else (dout_TD.to(acc), w_c.to(acc))
        n_rows = y_c.shape[0]
        dy_AD = y_c.new_empty(n_rows, y_c.shape[1], dtype=ctx.y_dtype) if ctx.needs_input_grad[0] else None
        dw_A = y_c.new_empty(n_rows, dtype=acc) if ctx.needs_input_grad[2] else None
        # In blocks of rows whose accumulation-dtype gradient stays in cache: one pass over y and dy instead of
        # a gathered [A, D] gradient written and read back (S2: 22 -> 11 ms).
        for lo in range(0, n_rows, cpu.WIDEN_BLOCK_ROWS):
            hi = min(lo + cpu.WIDEN_BLOCK_ROWS, n_rows)
            g_BD = dout_TD.index_select(0, token_idx_A[lo:hi])  # [B, D]
            if dw_A is not None:
                torch.linalg.vecdot(g_BD.to(acc), y_c[lo:hi].to(acc), out=dw_A[lo:hi])
            if dy_AD is not None:
                torch.mul(g_BD, w_A[lo:hi].unsqueeze(1), out=dy_AD[lo:hi])
        return dy_AD, None, None if dw_A is None else dw_A.to(ctx.w_dtype), None, None


def _swiglu_mlp_forward(x_AD, w13_EDF2, w2_EFD, bounds: RowBounds):
    """-> h13 [A, 2F], silu(gate) [A, F], h [A, F], y [A, D]: the whole-tensor schedule, each GEMM over all experts
    and each elementwise pass over all rows."""
    n_rows, n_ffn = x_AD.shape[0], w2_EFD.shape[1]
    h13_AF2 = grouped_mm(x_AD, w13_EDF2, bounds)  # [A, 2F]
    silu_AF, h_AF = h13_AF2.new_empty(n_rows, n_ffn), h13_AF2.new_empty(n_rows, n_ffn)  # [A, F] each
    swiglu(h13_AF2, silu_AF, h_AF)
    return h13_AF2, silu_AF, h_AF, grouped_mm(h_AF, w2_EFD, bounds)


def _swiglu_mlp_backward(saved, dy_AD, bounds: RowBounds, needs):
    """-> dx [A, D], dw13 [E, D, 2F], dw2 [E, F, D] (None where not needed): the whole-tensor schedule."""
    x_AD, w13_EDF2, w2_EFD, h13_AF2, silu_AF, h_AF = saved
    dh_AF = grouped_mm(dy_AD, w2_EFD.transpose(1, 2), bounds)  # [A, F]
    dw2_EFD = grouped_wgrad(h_AF, dy_AD, bounds) if needs[2] else None
    dh13_AF2 = torch.empty_like(h13_AF2)  # [A, 2F] = [d gate | d up]
    swiglu_backward(dh_AF, h13_AF2, silu_AF, dh13_AF2)
    dx_AD = grouped_mm(dh13_AF2, w13_EDF2.transpose(1, 2), bounds) if needs[0] else None
    dw13_EDF2 = grouped_wgrad(x_AD, dh13_AF2, bounds) if needs[1] else None
    return dx_AD, dw13_EDF2, dw2_EFD


def _schedule(x_AD: torch.Tensor, bounds: RowBounds, n_ffn: int) -> tuple[str, int]:
    """How the SwiGLU MLP runs, and its padded row count: "padded" (rows > 0) or "by_expert" for 16-bit rows on
    a CPU, else "whole_tensor"."""
    if not _builds_kernel_per_shape(x_AD):
        return "whole_tensor", 0
    rows = cpu.padded_rows(bounds.ints, x_AD.shape[1], n_ffn)
    return ("padded" if rows else "by_expert"), rows


class _SwiGLUExperts(torch.autograd.Function):
    """y = (silu(x @ W1) * (x @ W3)) @ W2 per expert, with a hand-written backward."""

    @staticmethod
    def forward(ctx, x_AD, w13_EDF2, w2_EFD, offsets_E, dtype, reads):
        math = math_dtype(dtype, x_AD.device)
        bounds = RowBounds(offsets_E, x_AD.shape[0], reads)
        x_m = round_to(x_AD, dtype, math)
        w13_m = round_to(w13_EDF2, dtype, math)
        w2_m = round_to(w2_EFD, dtype, math)
        ctx.schedule, rows = _schedule(x_m, bounds, w2_m.shape[1])
        if ctx.schedule == "padded":
            x_m, h13_AF2, silu_AF, h_AF, y_AD = cpu.swiglu_mlp_forward_padded(x_m, w13_m, w2_m, bounds.ints, rows)
        elif ctx.schedule == "by_expert":
            h13_AF2, silu_AF, h_AF, y_AD = cpu.swiglu_mlp_forward_by_expert(x_m, w13_m, w2_m, bounds.ints)
        else:
            h13_AF2, silu_AF, h_AF, y_AD = _swiglu_mlp_forward(x_m, w13_m, w2_m, bounds)
        # Saved (padded [E, R, .] in the padded schedule): backward needs silu(gate) twice and h once, so it
        # recomputes nothing. The offsets go in `ctx.bounds`, with their host integers if the forward read them.
        ctx.save_for_backward(x_m, w13_m, w2_m, h13_AF2, silu_AF, h_AF)
        ctx.bounds, ctx.dtype, ctx.math = bounds, dtype, math
        ctx.in_dtypes = (x_AD.dtype, w13_EDF2.dtype, w2_EFD.dtype)
        return y_AD.to(dtype)

    @staticmethod
    @_backward_without_autocast
    def backward(ctx, dy_AD):
        saved = ctx.saved_tensors  # x, w13, w2, h13, silu(gate), h
        # torch's grouped GEMM's own backward rejects stride-0 grads; ours needs dense rows too.
        dy_m = round_to(dy_AD, ctx.dtype, ctx.math).contiguous()
        needs = needed_input_grads(ctx)[:3]  # under zero bubble, the input pass's or the weight pass's
        if ctx.schedule == "padded":
            grads = cpu.swiglu_mlp_backward_padded(saved, dy_m, ctx.bounds.ints, needs)
        elif ctx.schedule == "by_expert":
            grads = cpu.swiglu_mlp_backward_by_expert(saved, dy_m, ctx.bounds.ints, needs)
        else:
            grads = _swiglu_mlp_backward(saved, dy_m, ctx.bounds, needs)
        grads = [None if g is None else g.to(in_dtype) for g, in_dtype in zip(grads, ctx.in_dtypes)]
        return *grads, None, None, None


def permute(x_TD: torch.Tensor, token_idx_A: torch.Tensor) -> torch.Tensor:
    """x_AD[a] = x_TD[token_idx_A[a]]."""
    dtype = compute_dtype(x_TD)
    with _no_autocast(x_TD.device.type):
        return _Permute.apply(x_TD, token_idx_A, dtype)


def expert_swiglu_mlp(
    x_AD: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor,
    reads: RowReads | None = None,
) -> torch.Tensor:  # fmt: skip
    """Per-expert SwiGLU MLP over expert-sorted rows (see reference.expert_swiglu_mlp); `reads`: see RowBounds."""
    dtype = compute_dtype(x_AD)
    with _no_autocast(x_AD.device.type):
        return _SwiGLUExperts.apply(x_AD, w13_EDF2, w2_EFD, offsets_E.to(torch.int32), dtype, reads)


def combine(y_AD: torch.Tensor, token_idx_A: torch.Tensor, weight_A: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """out[t] = sum over assignments a of token t of weight_A[a] * y_AD[a]."""
    dtype = compute_dtype(y_AD)
    with _no_autocast(y_AD.device.type):
        return _Combine.apply(y_AD, token_idx_A, weight_A, n_tokens, dtype)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_AK, w_EKN, offsets_E, dtype, reads):
        math = math_dtype(dtype, x_AK.device)
        bounds = RowBounds(offsets_E, x_AK.shape[0], reads)
        x_m, w_m = round_to(x_AK, dtype, math), round_to(w_EKN, dtype, math)
        ctx.save_for_backward(x_m, w_m)
        ctx.bounds, ctx.dtype, ctx.math, ctx.in_dtypes = bounds, dtype, math, (x_AK.dtype, w_EKN.dtype)
        return grouped_mm(x_m, w_m, bounds).to(dtype)

    @staticmethod
    @_backward_without_autocast
    def backward(ctx, dy_AN):
        x_m, w_m = ctx.saved_tensors
        dy_m = round_to(dy_AN, ctx.dtype, ctx.math).contiguous()
        dx = dw = None
        needs_x, needs_w = needed_input_grads(ctx)[:2]
        if needs_x:
            dx = grouped_mm(dy_m, w_m.transpose(1, 2), ctx.bounds).to(ctx.in_dtypes[0])
        if needs_w:
            dw = grouped_wgrad(x_m, dy_m, ctx.bounds).to(ctx.in_dtypes[1])
        return dx, dw, None, None, None


def grouped_mm_op(
    x_AK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor, reads: RowReads | None = None
) -> torch.Tensor:
    """Differentiable grouped GEMM: y[rows of e] = x[rows of e] @ w[e]; `reads`: see RowBounds."""
    dtype = compute_dtype(x_AK)
    with _no_autocast(x_AK.device.type):
        return _GroupedMM.apply(x_AK, w_EKN, offsets_E.to(torch.int32), dtype, reads)
