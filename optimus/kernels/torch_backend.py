"""The plain-PyTorch expert path, tuned for CPUs (works on any device).

- permute / combine: `index_select` one way; the other way (a sum over each token's rows) is
  a CSR sparse x dense matmul on CPUs, `index_add_` elsewhere; no Python loop over tokens.
  16-bit rows are widened to fp32 a block at a time, in cache.
- expert MLP: one custom autograd.Function for the whole SwiGLU MLP; GEMMs are
  `torch.nn.functional.grouped_mm` (one call per GEMM for all experts, weight grads included; through
  `torch_private`) with a per-expert `torch.mm(out=)` loop when it is missing or strides are not 16-byte
  aligned. 16-bit GEMMs on a CPU run per expert on row counts from a small fixed set
  (`cached_rows`), so that oneDNN's kernels for them stay cached from step to step, and
  there the MLP runs one expert at a time (GEMM, SwiGLU, GEMM on rows still in cache), or, for
  small experts with even loads, as batched GEMMs over every expert's rows padded to one count.
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

from optimus.kernels.counting import count_ids
from optimus.kernels.dtypes import compute_dtype, math_dtype, round_to
from optimus.kernels.host_reads import group_bounds, token_row_starts
from optimus.kernels.torch_private import FakeTensor
from optimus.kernels.torch_private import grouped_mm as torch_grouped_mm

_HAS_GROUPED_MM = torch_grouped_mm is not None


def _address(t: torch.Tensor) -> int:
    """t's address; for a fake tensor, which has no memory, its offset into a storage that starts 16-byte aligned
    (as every allocator's does)."""
    return t.storage_offset() * t.element_size() if isinstance(t, FakeTensor) else t.data_ptr()


def _aligned(*tensors: torch.Tensor) -> bool:
    """`_grouped_mm` needs every non-unit stride and the base address 16-byte aligned."""
    for t in tensors:
        if _address(t) % 16:
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


def _mm_window(a_AK: torch.Tensor, b_KN: torch.Tensor, out_AN: torch.Tensor, lo: int, hi: int) -> None:
    """out[lo:hi] = a[lo:hi] @ b as one GEMM on `cached_rows(hi - lo)` rows. The window runs past row `hi` into
    the next experts' rows (their products are computed and dropped), so no row of `a` is copied or padded: it
    writes rows of `out` past `hi` too, which those experts overwrite when their turn comes (experts go in
    order). A window that would read past a's end takes the rows before `lo` instead, through a scratch output."""
    n_rows, rows = a_AK.shape[0], cached_rows(hi - lo)
    if rows > n_rows:  # fewer rows in all than the window: exact
        torch.mm(a_AK[lo:hi], b_KN, out=out_AN[lo:hi])
    elif lo + rows <= n_rows:
        torch.mm(a_AK[lo : lo + rows], b_KN, out=out_AN[lo : lo + rows])
    else:
        start = n_rows - rows
        out_AN[lo:hi] = torch.mm(a_AK[start:], b_KN)[lo - start : hi - start]


def _wgrad_rows(a_AK: torch.Tensor, g_AN: torch.Tensor, out_KN: torch.Tensor, lo: int, hi: int) -> None:
    """out = a[lo:hi]^T @ g[lo:hi], the bulk on a cached row count. Rows are the reduction here, so the GEMM may
    not borrow other experts' rows (they would add to the sum): the rows split into the largest cached count at
    or below them and a tail of fewer than one `_row_step` rows, whose product is added. Tails come in fewer
    sizes than a `_row_step` per octave, so their kernels stay cached too (a tail zero-padded to a whole step
    measured 1.8x slower: it multiplies the zeros)."""
    if hi == lo:
        out_KN.zero_()
        return
    tail = (hi - lo) % _row_step(hi - lo)  # `hi - lo - tail` is a cached count
    a_KA = a_AK.t()
    torch.mm(a_KA[:, lo : hi - tail], g_AN[lo : hi - tail], out=out_KN)
    if tail:
        out_KN.addmm_(a_KA[:, hi - tail : hi], g_AN[hi - tail : hi])


def _wgrad_window(a_AK: torch.Tensor, g_AN: torch.Tensor, out_KN: torch.Tensor, lo: int, hi: int) -> None:
    """_wgrad_rows as one GEMM on a cached row count, for a `g` whose rows past `hi` are still to be written (by
    later experts): it zeroes them, so the window may run past the expert's rows without adding to the sum."""
    rows = cached_rows(hi - lo)
    if hi == lo or lo + rows > a_AK.shape[0]:
        _wgrad_rows(a_AK, g_AN, out_KN, lo, hi)
        return
    g_AN[hi : lo + rows].zero_()
    torch.mm(a_AK.t()[:, lo : lo + rows], g_AN[lo : lo + rows], out=out_KN)


class RowBounds:
    """Each expert's rows: `offsets_E` (int32 [E], the end row of each expert, `n_rows` in all) where they live,
    and `ints`, [0] + offsets as host integers, read back only when first asked for.

    Reading them is a host synchronisation on a GPU (the launch queue drains while the host waits), so only
    the per-expert loops ask, which slice rows by host integers: the CPU's paths, and a GPU's where
    grouped_mm cannot run (`_use_grouped`). grouped_mm takes the offsets where they are.
    """

    def __init__(self, offsets_E: torch.Tensor, n_rows: int):
        self.offsets_E, self.n_rows = offsets_E, n_rows

    @functools.cached_property
    def ints(self) -> list[int]:
        return group_bounds(self.offsets_E, self.n_rows)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM (`torch_private.grouped_mm`): [A, K] x [E, K, N] -> [A, N], or [K, A] x [A, N] ->
    [E, K, N]. Fake tensors (a dry run) run its meta kernel, which refuses all but bf16 (the CUDA kernel's rule)
    where the CPU kernel takes fp32 and fp16 too: for those it gives the empty output of the shape the CPU kernel
    would, as a fake kernel does."""
    if isinstance(a, FakeTensor) and a.dtype != torch.bfloat16:
        return a.new_empty((a.shape[0], b.shape[2]) if b.dim() == 3 else (offsets_E.shape[0], a.shape[0], b.shape[1]))
    return torch_grouped_mm(a, b, offs=offsets_E)


def _grouped_mm_cached_rows(x_AK: torch.Tensor, w_EKN: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """grouped_mm with every GEMM on a cached row count (`_mm_window`)."""
    y_AN = x_AK.new_empty(x_AK.shape[0], w_EKN.shape[2])  # [A, N]
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi > lo:
            _mm_window(x_AK, w_EKN[e], y_AN, lo, hi)
    return y_AN


def _grouped_wgrad_cached_rows(x_AK: torch.Tensor, g_AN: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """grouped_wgrad with the bulk of every GEMM on a cached row count (`_wgrad_rows`)."""
    dw_EKN = x_AK.new_empty(len(bounds) - 1, x_AK.shape[1], g_AN.shape[1])  # [E, K, N]
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        _wgrad_rows(x_AK, g_AN, dw_EKN[e], lo, hi)
    return dw_EKN


def grouped_mm(x_AK: torch.Tensor, w_EKN: torch.Tensor, bounds: RowBounds) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e]  -> [A, N]."""
    if _builds_kernel_per_shape(x_AK):
        return _grouped_mm_cached_rows(x_AK, w_EKN, bounds.ints)
    if _use_grouped(w_EKN.shape[0], x_AK, w_EKN):
        return _grouped_mm(x_AK, w_EKN, bounds.offsets_E)
    y_AN = x_AK.new_empty(x_AK.shape[0], w_EKN.shape[2])
    for e in range(w_EKN.shape[0]):
        lo, hi = bounds.ints[e], bounds.ints[e + 1]
        if hi > lo:
            torch.mm(x_AK[lo:hi], w_EKN[e], out=y_AN[lo:hi])
    return y_AN


def grouped_wgrad(x_AK: torch.Tensor, g_AN: torch.Tensor, bounds: RowBounds) -> torch.Tensor:
    """dw[e] = x[rows of e]^T @ g[rows of e]  -> [E, K, N]; zero for experts without rows."""
    if _builds_kernel_per_shape(x_AK):
        return _grouped_wgrad_cached_rows(x_AK, g_AN, bounds.ints)
    x_KA = x_AK.t()
    n_experts = bounds.offsets_E.shape[0]
    if _use_grouped(n_experts, x_KA, g_AN):
        return _grouped_mm(x_KA, g_AN, bounds.offsets_E)
    dw_EKN = x_AK.new_empty(n_experts, x_AK.shape[1], g_AN.shape[1])
    for e in range(n_experts):
        lo, hi = bounds.ints[e], bounds.ints[e + 1]
        if hi > lo:
            torch.mm(x_KA[:, lo:hi], g_AN[lo:hi], out=dw_EKN[e])
        else:
            dw_EKN[e].zero_()
    return dw_EKN


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


# Rows per block where permute's backward and combine widen 16-bit [A, D] rows in cache rather than all at once
# (1024 x 512 fp32 = 2 MiB; S2's combine backward measured 10.7 ms at 512 rows, 11.1 at 1024, 15.5 at 4096).
_WIDEN_BLOCK_ROWS = 1024


def _scatter_sum(src_AD: torch.Tensor, token_idx_A: torch.Tensor, weight_A, n_tokens: int, acc) -> torch.Tensor:
    """out[t] = sum over a with token_idx_A[a] == t of weight_A[a] * src_AD[a] -> [T, D] in `acc`, summed in `acc`
    (weight None = 1).

    On CPUs a [T, A] CSR matrix times src (MKL sparse, multi-threaded) is several times faster
    than `index_add_`, which runs serially there; elsewhere `index_add_` is the fast one.
    """
    # Sparse CSR tensors do not run on fake tensors: a dry run (optimus plan --dry-run) takes index_add here.
    csr = src_AD.device.type == "cpu" and not isinstance(src_AD, FakeTensor)
    if csr and acc in (torch.float32, torch.float64) and src_AD.shape[0]:
        return _csr_scatter_sum(src_AD, token_idx_A, weight_A, n_tokens, acc)
    src_AD = src_AD.to(acc)
    if weight_A is not None:
        src_AD = src_AD * weight_A.to(acc).unsqueeze(1)
    return src_AD.new_zeros(n_tokens, src_AD.shape[1]).index_add_(0, token_idx_A, src_AD)


def _csr_matrix(crow, col, values, shape) -> torch.Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def _csr_scatter_sum(src_AD, token_idx_A, weight_A, n_tokens: int, acc) -> torch.Tensor:
    """_scatter_sum as CSR x dense. Rows in `acc` are read where they lie; 16-bit rows are gathered in token order
    and widened a block of tokens at a time, in cache (S2's [32768, 512] bf16: 10.8 -> 7.8 ms against widening
    it whole first)."""
    n_rows = src_AD.shape[0]
    order_A = torch.argsort(token_idx_A, stable=True)  # rows in token order
    crow_T1 = torch.zeros(n_tokens + 1, dtype=torch.int64)
    torch.cumsum(count_ids(token_idx_A, n_tokens), 0, out=crow_T1[1:])
    values_A = torch.ones(n_rows, dtype=acc) if weight_A is None else weight_A.to(acc)[order_A]
    if src_AD.dtype == acc:
        return torch.sparse.mm(_csr_matrix(crow_T1, order_A, values_A, (n_tokens, n_rows)), src_AD)
    out_TD = src_AD.new_empty(n_tokens, src_AD.shape[1], dtype=acc)
    tokens_per_block = max(1, _WIDEN_BLOCK_ROWS * n_tokens // n_rows)
    block_starts = list(range(0, n_tokens, tokens_per_block)) + [n_tokens]
    row_starts = token_row_starts(crow_T1[block_starts], block_starts, n_rows, n_tokens)
    local_col = torch.arange(n_rows)
    for t0, t1, r0, r1 in zip(block_starts[:-1], block_starts[1:], row_starts[:-1], row_starts[1:]):
        if r1 == r0:  # no token of the block kept a row (capacity drops)
            out_TD[t0:t1].zero_()
            continue
        rows_RD = src_AD.index_select(0, order_A[r0:r1]).to(acc)  # [R, D], this block's rows in token order
        block = _csr_matrix(crow_T1[t0 : t1 + 1] - r0, local_col[: r1 - r0], values_A[r0:r1], (t1 - t0, r1 - r0))
        out_TD[t0:t1] = torch.sparse.mm(block, rows_RD)
    return out_TD


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
        dout_acc_TD, w_acc_A = dout_TD.to(acc), w_c.to(acc)
        n_rows = y_c.shape[0]
        dy_AD = y_c.new_empty(n_rows, y_c.shape[1], dtype=ctx.y_dtype) if ctx.needs_input_grad[0] else None
        dw_A = w_acc_A.new_empty(n_rows) if ctx.needs_input_grad[2] else None
        # In blocks of rows whose accumulation-dtype gradient stays in cache: one pass over y and dy instead of
        # a gathered [A, D] gradient written and read back (S2: 22 -> 11 ms).
        for lo in range(0, n_rows, _WIDEN_BLOCK_ROWS):
            hi = min(lo + _WIDEN_BLOCK_ROWS, n_rows)
            g_BD = dout_acc_TD.index_select(0, token_idx_A[lo:hi])  # [B, D]
            if dw_A is not None:
                torch.linalg.vecdot(g_BD, y_c[lo:hi].to(acc), out=dw_A[lo:hi])
            if dy_AD is not None:
                torch.mul(g_BD, w_acc_A[lo:hi].unsqueeze(1), out=dy_AD[lo:hi])
        return dy_AD, None, None if dw_A is None else dw_A.to(ctx.w_dtype), None, None


def _swiglu(h13_RF2: torch.Tensor, silu_RF: torch.Tensor, h_RF: torch.Tensor) -> None:
    """silu_RF = silu(gate), h_RF = silu(gate) * up, for h13 = [gate | up]."""
    n_ffn = silu_RF.shape[1]
    torch.ops.aten.silu.out(h13_RF2[:, :n_ffn], out=silu_RF)
    torch.mul(silu_RF, h13_RF2[:, n_ffn:], out=h_RF)


def _swiglu_backward(dh_RF: torch.Tensor, h13_RF2: torch.Tensor, silu_RF: torch.Tensor, dh13_RF2: torch.Tensor):
    """dh13_RF2 = [d gate | d up] from dh = d(silu(gate) * up); overwrites dh_RF."""
    n_ffn = silu_RF.shape[1]
    gate_RF, up_RF = h13_RF2[:, :n_ffn], h13_RF2[:, n_ffn:]
    torch.mul(dh_RF, silu_RF, out=dh13_RF2[:, n_ffn:])
    torch.mul(dh_RF, up_RF, out=dh_RF)
    torch.ops.aten.silu_backward.grad_input(dh_RF, gate_RF, grad_input=dh13_RF2[:, :n_ffn])


def _swiglu_mlp_forward(x_AD, w13_EDF2, w2_EFD, bounds: RowBounds):
    """-> h13 [A, 2F], silu(gate) [A, F], h [A, F], y [A, D]: the whole-tensor schedule, each GEMM over all experts
    and each elementwise pass over all rows."""
    n_rows, n_ffn = x_AD.shape[0], w2_EFD.shape[1]
    h13_AF2 = grouped_mm(x_AD, w13_EDF2, bounds)  # [A, 2F]
    silu_AF, h_AF = h13_AF2.new_empty(n_rows, n_ffn), h13_AF2.new_empty(n_rows, n_ffn)  # [A, F] each
    _swiglu(h13_AF2, silu_AF, h_AF)
    return h13_AF2, silu_AF, h_AF, grouped_mm(h_AF, w2_EFD, bounds)


def _swiglu_mlp_forward_by_expert(x_AD, w13_EDF2, w2_EFD, bounds):
    """_swiglu_mlp_forward, one expert at a time (16-bit on a CPU): an expert's rows of h13 and h are used while
    they are still in cache, and every GEMM runs on a cached row count. A window's rows past the expert's own
    belong to later experts, which overwrite what it wrote there (in h13 and y; h is read there before it is
    written, and only the dropped rows of y depend on it)."""
    n_rows, n_ffn = x_AD.shape[0], w2_EFD.shape[1]
    h13_AF2 = x_AD.new_empty(n_rows, 2 * n_ffn)  # [A, 2F]
    silu_AF, h_AF = x_AD.new_empty(n_rows, n_ffn), x_AD.new_empty(n_rows, n_ffn)  # [A, F] each
    y_AD = x_AD.new_empty(n_rows, w2_EFD.shape[2])  # [A, D]
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi == lo:
            continue
        _mm_window(x_AD, w13_EDF2[e], h13_AF2, lo, hi)
        _swiglu(h13_AF2[lo:hi], silu_AF[lo:hi], h_AF[lo:hi])
        _mm_window(h_AF, w2_EFD[e], y_AD, lo, hi)
    return h13_AF2, silu_AF, h_AF, y_AD


def _swiglu_mlp_backward(saved, dy_AD, bounds: RowBounds, needs):
    """-> dx [A, D], dw13 [E, D, 2F], dw2 [E, F, D] (None where not needed): the whole-tensor schedule."""
    x_AD, w13_EDF2, w2_EFD, h13_AF2, silu_AF, h_AF = saved
    dh_AF = grouped_mm(dy_AD, w2_EFD.transpose(1, 2), bounds)  # [A, F]
    dw2_EFD = grouped_wgrad(h_AF, dy_AD, bounds) if needs[2] else None
    dh13_AF2 = torch.empty_like(h13_AF2)  # [A, 2F] = [d gate | d up]
    _swiglu_backward(dh_AF, h13_AF2, silu_AF, dh13_AF2)
    dx_AD = grouped_mm(dh13_AF2, w13_EDF2.transpose(1, 2), bounds) if needs[0] else None
    dw13_EDF2 = grouped_wgrad(x_AD, dh13_AF2, bounds) if needs[1] else None
    return dx_AD, dw13_EDF2, dw2_EFD


def _swiglu_mlp_backward_by_expert(saved, dy_AD, bounds, needs):
    """_swiglu_mlp_backward one expert at a time, as `_swiglu_mlp_forward_by_expert` runs the forward (dh and
    dh13 rows past an expert's own are later experts', overwritten by them; only dropped rows of dx depend on
    them)."""
    x_AD, w13_EDF2, w2_EFD, h13_AF2, silu_AF, h_AF = saved
    dh_AF = torch.empty_like(silu_AF)  # [A, F]
    dh13_AF2 = torch.empty_like(h13_AF2)  # [A, 2F] = [d gate | d up]
    dx_AD = torch.empty_like(x_AD) if needs[0] else None
    dw13_EDF2 = torch.empty_like(w13_EDF2) if needs[1] else None
    dw2_EFD = torch.empty_like(w2_EFD) if needs[2] else None
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi == lo:  # no rows: zero weight gradients, nothing else
            for dw_EKN in (dw13_EDF2, dw2_EFD):
                if dw_EKN is not None:
                    dw_EKN[e].zero_()
            continue
        _mm_window(dy_AD, w2_EFD[e].t(), dh_AF, lo, hi)
        if dw2_EFD is not None:
            _wgrad_rows(h_AF, dy_AD, dw2_EFD[e], lo, hi)
        _swiglu_backward(dh_AF[lo:hi], h13_AF2[lo:hi], silu_AF[lo:hi], dh13_AF2[lo:hi])
        if dx_AD is not None:
            _mm_window(dh13_AF2, w13_EDF2[e].t(), dx_AD, lo, hi)
        if dw13_EDF2 is not None:  # after dx: dh13's rows past hi only fed dropped rows of dx
            _wgrad_window(x_AD, dh13_AF2, dw13_EDF2[e], lo, hi)
    return dx_AD, dw13_EDF2, dw2_EFD


# Small experts are faster as one batched GEMM over rows padded to a common count than one GEMM each: per-call
# overhead and oneDNN's small-GEMM rate outweigh the padding. 16-bit SwiGLU MLP forward + backward on 2 cores
# (AVX512-BF16), padded schedule / per-expert schedule, uniform top-k routing (max/mean load 1.1-1.15), mean rows
# x D x F per expert: 0.84 at 13M (E 128, D 256, F 128), 0.92 at 34M (E 8, D 256, F 256), 1.00 at 34M (E 64),
# 0.91 at 38M (E 128, D 384, F 192), 1.09 at 67M (E 32, D 256, F 512), 1.05 at 67M (E 64, D 512, F 256), 1.10 at
# 151M (E 16, D 768, F 384). Loads less even than this pad more rows than they save.
_PADDED_MAX_EXPERT_MACS = 48 << 20
_PADDED_MAX_ROWS_RATIO = 1.25


def padded_rows(bounds: list[int], n_dim: int, n_ffn: int) -> int:
    """Rows per expert of the padded batched schedule (a cached row count), or 0 where the per-expert schedule is
    the faster: experts too large, or loads too uneven."""
    n_experts, n_rows = len(bounds) - 1, bounds[-1]
    if n_rows == 0 or n_rows * n_dim * n_ffn > _PADDED_MAX_EXPERT_MACS * n_experts:
        return 0
    rows = cached_rows(max(hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])))
    return rows if n_experts * rows <= _PADDED_MAX_ROWS_RATIO * n_rows else 0


def _padded_index(bounds: list[int], rows: int, device: torch.device) -> torch.Tensor:
    """index_A[a] = the row of assignment a in the padded [E * rows] layout (expert e's rows start at e * rows)."""
    starts_E = torch.tensor(bounds[:-1], dtype=torch.int64)
    shift_E = torch.arange(len(starts_E), dtype=torch.int64) * rows - starts_E
    counts_E = torch.tensor(bounds[1:], dtype=torch.int64) - starts_E
    shift_A = torch.repeat_interleave(shift_E, counts_E, output_size=bounds[-1])
    return (torch.arange(bounds[-1]) + shift_A).to(device)  # [A]


def _pad(x_AD: torch.Tensor, index_A: torch.Tensor, n_experts: int, rows: int) -> torch.Tensor:
    """-> [E, rows, D]: x's rows at index_A, zero elsewhere (zero rows add nothing to a weight gradient)."""
    out = x_AD.new_zeros(n_experts * rows, x_AD.shape[1])
    return out.index_copy_(0, index_A, x_AD).view(n_experts, rows, -1)


def _swiglu_mlp_forward_padded(x_AD, w13_EDF2, w2_EFD, bounds, rows):
    """_swiglu_mlp_forward as batched GEMMs over every expert's rows padded to `rows` (16-bit on a CPU, small
    experts): -> padded x [E, R, D], h13 [E, R, 2F], silu(gate) and h [E, R, F] each, and y [A, D]."""
    n_experts, n_ffn = w2_EFD.shape[0], w2_EFD.shape[1]
    index_A = _padded_index(bounds, rows, x_AD.device)
    x_ERD = _pad(x_AD, index_A, n_experts, rows)
    h13_ERF2 = torch.bmm(x_ERD, w13_EDF2)  # [E, R, 2F]
    silu_ERF, h_ERF = x_AD.new_empty(n_experts, rows, n_ffn), x_AD.new_empty(n_experts, rows, n_ffn)
    _swiglu(h13_ERF2.view(-1, 2 * n_ffn), silu_ERF.view(-1, n_ffn), h_ERF.view(-1, n_ffn))
    y_AD = torch.bmm(h_ERF, w2_EFD).view(n_experts * rows, -1).index_select(0, index_A)  # [A, D]
    return x_ERD, h13_ERF2, silu_ERF, h_ERF, y_AD


def _swiglu_mlp_backward_padded(saved, dy_AD, bounds, needs):
    """_swiglu_mlp_backward over the padded tensors `_swiglu_mlp_forward_padded` saved. The padding rows of dy are
    zero, so theirs of dh and dh13 are too, and they add nothing to the weight gradients."""
    x_ERD, w13_EDF2, w2_EFD, h13_ERF2, silu_ERF, h_ERF = saved
    n_experts, rows, n_ffn = h_ERF.shape
    index_A = _padded_index(bounds, rows, dy_AD.device)
    dy_ERD = _pad(dy_AD, index_A, n_experts, rows)
    dh_ERF = torch.bmm(dy_ERD, w2_EFD.transpose(1, 2))  # [E, R, F]
    dw2_EFD = torch.bmm(h_ERF.transpose(1, 2), dy_ERD) if needs[2] else None
    dh13_ERF2 = torch.empty_like(h13_ERF2)  # [E, R, 2F] = [d gate | d up]
    _swiglu_backward(dh_ERF.view(-1, n_ffn), h13_ERF2.view(-1, 2 * n_ffn), silu_ERF.view(-1, n_ffn),
                     dh13_ERF2.view(-1, 2 * n_ffn))  # fmt: skip
    dx_AD = None
    if needs[0]:
        dx_AD = torch.bmm(dh13_ERF2, w13_EDF2.transpose(1, 2)).view(n_experts * rows, -1).index_select(0, index_A)
    dw13_EDF2 = torch.bmm(x_ERD.transpose(1, 2), dh13_ERF2) if needs[1] else None
    return dx_AD, dw13_EDF2, dw2_EFD


def _schedule(x_AD: torch.Tensor, bounds: RowBounds, n_ffn: int) -> tuple[str, int]:
    """How the SwiGLU MLP runs, and its padded row count: "padded" (rows > 0) or "by_expert" for 16-bit rows on
    a CPU, else "whole_tensor"."""
    if not _builds_kernel_per_shape(x_AD):
        return "whole_tensor", 0
    rows = padded_rows(bounds.ints, x_AD.shape[1], n_ffn)
    return ("padded" if rows else "by_expert"), rows


class _SwiGLUExperts(torch.autograd.Function):
    """y = (silu(x @ W1) * (x @ W3)) @ W2 per expert, with a hand-written backward."""

    @staticmethod
    def forward(ctx, x_AD, w13_EDF2, w2_EFD, offsets_E, dtype):
        math = math_dtype(dtype, x_AD.device)
        bounds = RowBounds(offsets_E, x_AD.shape[0])
        x_m = round_to(x_AD, dtype, math)
        w13_m = round_to(w13_EDF2, dtype, math)
        w2_m = round_to(w2_EFD, dtype, math)
        ctx.schedule, rows = _schedule(x_m, bounds, w2_m.shape[1])
        if ctx.schedule == "padded":
            x_m, h13_AF2, silu_AF, h_AF, y_AD = _swiglu_mlp_forward_padded(x_m, w13_m, w2_m, bounds.ints, rows)
        elif ctx.schedule == "by_expert":
            h13_AF2, silu_AF, h_AF, y_AD = _swiglu_mlp_forward_by_expert(x_m, w13_m, w2_m, bounds.ints)
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
        # _grouped_mm's own backward rejects stride-0 grads; ours needs dense rows too.
        dy_m = round_to(dy_AD, ctx.dtype, ctx.math).contiguous()
        needs = ctx.needs_input_grad[:3]
        if ctx.schedule == "padded":
            grads = _swiglu_mlp_backward_padded(saved, dy_m, ctx.bounds.ints, needs)
        elif ctx.schedule == "by_expert":
            grads = _swiglu_mlp_backward_by_expert(saved, dy_m, ctx.bounds.ints, needs)
        else:
            grads = _swiglu_mlp_backward(saved, dy_m, ctx.bounds, needs)
        grads = [None if g is None else g.to(in_dtype) for g, in_dtype in zip(grads, ctx.in_dtypes)]
        return *grads, None, None


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
        bounds = RowBounds(offsets_E, x_AK.shape[0])
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
        if ctx.needs_input_grad[0]:
            dx = grouped_mm(dy_m, w_m.transpose(1, 2), ctx.bounds).to(ctx.in_dtypes[0])
        if ctx.needs_input_grad[1]:
            dw = grouped_wgrad(x_m, dy_m, ctx.bounds).to(ctx.in_dtypes[1])
        return dx, dw, None, None


def grouped_mm_op(x_AK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Differentiable grouped GEMM: y[rows of e] = x[rows of e] @ w[e]."""
    dtype = compute_dtype(x_AK)
    with _no_autocast(x_AK.device.type):
        return _GroupedMM.apply(x_AK, w_EKN, offsets_E.to(torch.int32), dtype)
