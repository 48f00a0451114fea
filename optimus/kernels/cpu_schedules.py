"""The torch backend's CPU-only schedules: 16-bit expert GEMMs on cached row counts, the SwiGLU MLP one expert at
a time or as padded batched GEMMs, and the combine as a CSR sparse x dense product.

`torch_backend` chooses them (`_schedule`, `grouped_mm`, `grouped_wgrad`, `_scatter_sum`); they run on any
device but are only faster on a CPU:

- oneDNN, which runs PyTorch's 16-bit GEMMs on a CPU, builds (JIT-compiles) a kernel for every GEMM shape and
  caches it (1024 by default). An expert's row count changes every step, so exact-size GEMMs build new kernels
  every step: 8 experts of the default model, [~512, 256] x [256, 512] in bf16, ran at 152 GFLOP/s with new
  counts each call against 343 with repeated ones (2 cores, AVX512-BF16). Row counts rounded up to a sixteenth
  of their power of two (at most 6.25% more rows, 16 counts per octave) come from a set whose kernels stay
  cached: 310 GFLOP/s with new counts each call. fp32 goes to MKL, which builds nothing per shape.
- One expert at a time (GEMM, SwiGLU, GEMM), an expert's rows of h13 and h are used while still in cache.
- Small experts with even loads run as batched GEMMs over every expert's rows padded to one cached count.
- The sum over each token's rows (combine, permute's backward) is a [T, A] CSR matrix times the rows (MKL
  sparse, multi-threaded), several times faster than `index_add_`, which runs serially on a CPU.

Bounds are host integers here ([0, end of expert 0, ...], `RowBounds.ints`): every schedule loops over experts.
"""

import warnings

import torch

from optimus.kernels.counting import count_ids
from optimus.kernels.swiglu import swiglu, swiglu_backward

# ---- GEMMs on cached row counts

ROW_STEPS_PER_OCTAVE_LOG2 = 4
# Coarse experts: a GEMM of at least FINE_ROWS_MIN_MACS multiply-adds (an expert's rows x K x N) rounds to 32 row
# counts per octave (at most 3.1% more rows, 1.6% on average, against 6.25% and 3.1%). Such a GEMM runs for ~5 ms
# on one core, so the rows the coarser set pads cost it more than the kernels of twice as many row counts, which
# stay cached as well: T 4096, D 512, F 1024, E 8, top-2 (S1; 537M and 1074M multiply-adds per GEMM), bf16, one
# core, 15 round-robin steps: 462 -> 450 ms per forward + backward. Smaller GEMMs keep 16 counts per octave: their
# padding costs less than a kernel rebuilt whenever a row count falls out of oneDNN's cache.
FINE_ROW_STEPS_PER_OCTAVE_LOG2 = 5
FINE_ROWS_MIN_MACS = 1 << 29


def row_step(rows: int, macs_per_row: int = 0) -> int:
    """1/16 of the power of two at or below `rows` (1 below 32 rows); 1/32 for a GEMM of at least
    `FINE_ROWS_MIN_MACS` multiply-adds, `rows` x `macs_per_row` (the GEMM's other two dimensions)."""
    fine = rows * macs_per_row >= FINE_ROWS_MIN_MACS
    per_octave_log2 = FINE_ROW_STEPS_PER_OCTAVE_LOG2 if fine else ROW_STEPS_PER_OCTAVE_LOG2
    return 1 << max(0, rows.bit_length() - 1 - per_octave_log2)


def cached_rows(rows: int, macs_per_row: int = 0) -> int:
    """`rows` rounded up to a multiple of its `row_step`: 16 row counts per octave (32 for a large GEMM), exact
    below 32 rows. A count of the coarser set is one of the finer set too."""
    step = row_step(rows, macs_per_row)
    return -(-rows // step) * step


def mm_window(a_AK: torch.Tensor, b_KN: torch.Tensor, out_AN: torch.Tensor, lo: int, hi: int) -> None:
    """out[lo:hi] = a[lo:hi] @ b as one GEMM on `cached_rows(hi - lo)` rows. The window runs past row `hi` into
    the next experts' rows (their products are computed and dropped), so no row of `a` is copied or padded: it
    writes rows of `out` past `hi` too, which those experts overwrite when their turn comes (experts go in
    order). A window that would read past a's end takes the rows before `lo` instead, through a scratch output."""
    n_rows, rows = a_AK.shape[0], cached_rows(hi - lo, a_AK.shape[1] * b_KN.shape[1])
    if rows > n_rows:  # fewer rows in all than the window: exact
        torch.mm(a_AK[lo:hi], b_KN, out=out_AN[lo:hi])
    elif lo + rows <= n_rows:
        torch.mm(a_AK[lo : lo + rows], b_KN, out=out_AN[lo : lo + rows])
    else:
        start = n_rows - rows
        out_AN[lo:hi] = torch.mm(a_AK[start:], b_KN)[lo - start : hi - start]


def wgrad_rows(a_AK: torch.Tensor, g_AN: torch.Tensor, out_KN: torch.Tensor, lo: int, hi: int) -> None:
    """out = a[lo:hi]^T @ g[lo:hi], the bulk on a cached row count. Rows are the reduction here, so the GEMM may
    not borrow other experts' rows (they would add to the sum): the rows split into the largest cached count at
    or below them and a tail of fewer than one `row_step` rows, whose product is added. Tails come in fewer
    sizes than a `row_step` per octave, so their kernels stay cached too (a tail zero-padded to a whole step
    measured 1.8x slower: it multiplies the zeros)."""
    if hi == lo:
        out_KN.zero_()
        return
    tail = (hi - lo) % row_step(hi - lo, a_AK.shape[1] * g_AN.shape[1])  # `hi - lo - tail` is a cached count
    a_KA = a_AK.t()
    torch.mm(a_KA[:, lo : hi - tail], g_AN[lo : hi - tail], out=out_KN)
    if tail:
        out_KN.addmm_(a_KA[:, hi - tail : hi], g_AN[hi - tail : hi])


def wgrad_window(a_AK: torch.Tensor, g_AN: torch.Tensor, out_KN: torch.Tensor, lo: int, hi: int) -> None:
    """wgrad_rows as one GEMM on a cached row count, for a `g` whose rows past `hi` are still to be written (by
    later experts): it zeroes them, so the window may run past the expert's rows without adding to the sum."""
    rows = cached_rows(hi - lo, a_AK.shape[1] * g_AN.shape[1])
    if hi == lo or lo + rows > a_AK.shape[0]:
        wgrad_rows(a_AK, g_AN, out_KN, lo, hi)
        return
    g_AN[hi : lo + rows].zero_()
    torch.mm(a_AK.t()[:, lo : lo + rows], g_AN[lo : lo + rows], out=out_KN)


def grouped_mm_cached_rows(x_AK: torch.Tensor, w_EKN: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """grouped_mm with every GEMM on a cached row count (`mm_window`)."""
    y_AN = x_AK.new_empty(x_AK.shape[0], w_EKN.shape[2])  # [A, N]
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi > lo:
            mm_window(x_AK, w_EKN[e], y_AN, lo, hi)
    return y_AN


def grouped_wgrad_cached_rows(x_AK: torch.Tensor, g_AN: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """grouped_wgrad with the bulk of every GEMM on a cached row count (`wgrad_rows`)."""
    dw_EKN = x_AK.new_empty(len(bounds) - 1, x_AK.shape[1], g_AN.shape[1])  # [E, K, N]
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        wgrad_rows(x_AK, g_AN, dw_EKN[e], lo, hi)
    return dw_EKN


# ---- the SwiGLU MLP one expert at a time


def swiglu_mlp_forward_by_expert(x_AD, w13_EDF2, w2_EFD, bounds: list[int]):
    """-> h13 [A, 2F], silu(gate) [A, F], h [A, F], y [A, D], one expert at a time: an expert's rows of h13 and h
    are used while they are still in cache, and every GEMM runs on a cached row count. A window's rows past the
    expert's own belong to later experts, which overwrite what it wrote there (in h13 and y; h is read there
    before it is written, and only the dropped rows of y depend on it)."""
    n_rows, n_ffn = x_AD.shape[0], w2_EFD.shape[1]
    h13_AF2 = x_AD.new_empty(n_rows, 2 * n_ffn)  # [A, 2F]
    silu_AF, h_AF = x_AD.new_empty(n_rows, n_ffn), x_AD.new_empty(n_rows, n_ffn)  # [A, F] each
    y_AD = x_AD.new_empty(n_rows, w2_EFD.shape[2])  # [A, D]
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi == lo:
            continue
        mm_window(x_AD, w13_EDF2[e], h13_AF2, lo, hi)
        swiglu(h13_AF2[lo:hi], silu_AF[lo:hi], h_AF[lo:hi])
        mm_window(h_AF, w2_EFD[e], y_AD, lo, hi)
    return h13_AF2, silu_AF, h_AF, y_AD


def swiglu_mlp_backward_by_expert(saved, dy_AD, bounds: list[int], needs):
    """-> dx [A, D], dw13 [E, D, 2F], dw2 [E, F, D] (None where not needed), one expert at a time as
    `swiglu_mlp_forward_by_expert` runs the forward (dh and dh13 rows past an expert's own are later experts',
    overwritten by them; only dropped rows of dx depend on them)."""
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
        mm_window(dy_AD, w2_EFD[e].t(), dh_AF, lo, hi)
        if dw2_EFD is not None:
            wgrad_rows(h_AF, dy_AD, dw2_EFD[e], lo, hi)
        swiglu_backward(dh_AF[lo:hi], h13_AF2[lo:hi], silu_AF[lo:hi], dh13_AF2[lo:hi])
        if dx_AD is not None:
            mm_window(dh13_AF2, w13_EDF2[e].t(), dx_AD, lo, hi)
        if dw13_EDF2 is not None:  # after dx: dh13's rows past hi only fed dropped rows of dx
            wgrad_window(x_AD, dh13_AF2, dw13_EDF2[e], lo, hi)
    return dx_AD, dw13_EDF2, dw2_EFD


# ---- the SwiGLU MLP as batched GEMMs over padded rows

# Small experts are faster as one batched GEMM over rows padded to a common count than one GEMM each: per-call
# overhead and oneDNN's small-GEMM rate outweigh the padding. 16-bit SwiGLU MLP forward + backward on 2 cores
# (AVX512-BF16), padded schedule / per-expert schedule, uniform top-k routing (max/mean load 1.1-1.15), mean rows
# x D x F per expert: 0.84 at 13M (E 128, D 256, F 128), 0.92 at 34M (E 8, D 256, F 256), 1.00 at 34M (E 64),
# 0.91 at 38M (E 128, D 384, F 192), 1.09 at 67M (E 32, D 256, F 512), 1.05 at 67M (E 64, D 512, F 256), 1.10 at
# 151M (E 16, D 768, F 384). Loads less even than this pad more rows than they save.
PADDED_MAX_EXPERT_MACS = 48 << 20
PADDED_MAX_ROWS_RATIO = 1.25


def padded_rows(bounds: list[int], n_dim: int, n_ffn: int) -> int:
    """Rows per expert of the padded batched schedule (a cached row count), or 0 where the per-expert schedule is
    the faster: experts too large, or loads too uneven."""
    n_experts, n_rows = len(bounds) - 1, bounds[-1]
    if n_rows == 0 or n_rows * n_dim * n_ffn > PADDED_MAX_EXPERT_MACS * n_experts:
        return 0
    rows = cached_rows(max(hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])))
    return rows if n_experts * rows <= PADDED_MAX_ROWS_RATIO * n_rows else 0


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


def swiglu_mlp_forward_padded(x_AD, w13_EDF2, w2_EFD, bounds: list[int], rows: int):
    """The SwiGLU MLP as batched GEMMs over every expert's rows padded to `rows` (small experts): -> padded
    x [E, R, D], h13 [E, R, 2F], silu(gate) and h [E, R, F] each, and y [A, D]."""
    n_experts, n_ffn = w2_EFD.shape[0], w2_EFD.shape[1]
    index_A = _padded_index(bounds, rows, x_AD.device)
    x_ERD = _pad(x_AD, index_A, n_experts, rows)
    h13_ERF2 = torch.bmm(x_ERD, w13_EDF2)  # [E, R, 2F]
    silu_ERF, h_ERF = x_AD.new_empty(n_experts, rows, n_ffn), x_AD.new_empty(n_experts, rows, n_ffn)
    swiglu(h13_ERF2.view(-1, 2 * n_ffn), silu_ERF.view(-1, n_ffn), h_ERF.view(-1, n_ffn))
    y_AD = torch.bmm(h_ERF, w2_EFD).view(n_experts * rows, -1).index_select(0, index_A)  # [A, D]
    return x_ERD, h13_ERF2, silu_ERF, h_ERF, y_AD


def swiglu_mlp_backward_padded(saved, dy_AD, bounds: list[int], needs):
    """The backward over the padded tensors `swiglu_mlp_forward_padded` saved. The padding rows of dy are zero,
    so theirs of dh and dh13 are too, and they add nothing to the weight gradients."""
    x_ERD, w13_EDF2, w2_EFD, h13_ERF2, silu_ERF, h_ERF = saved
    n_experts, rows, n_ffn = h_ERF.shape
    index_A = _padded_index(bounds, rows, dy_AD.device)
    dy_ERD = _pad(dy_AD, index_A, n_experts, rows)
    dh_ERF = torch.bmm(dy_ERD, w2_EFD.transpose(1, 2))  # [E, R, F]
    dw2_EFD = torch.bmm(h_ERF.transpose(1, 2), dy_ERD) if needs[2] else None
    dh13_ERF2 = torch.empty_like(h13_ERF2)  # [E, R, 2F] = [d gate | d up]
    swiglu_backward(dh_ERF.view(-1, n_ffn), h13_ERF2.view(-1, 2 * n_ffn), silu_ERF.view(-1, n_ffn),
                    dh13_ERF2.view(-1, 2 * n_ffn))  # fmt: skip
    dx_AD = None
    if needs[0]:
        dx_AD = torch.bmm(dh13_ERF2, w13_EDF2.transpose(1, 2)).view(n_experts * rows, -1).index_select(0, index_A)
    dw13_EDF2 = torch.bmm(x_ERD.transpose(1, 2), dh13_ERF2) if needs[1] else None
    return dx_AD, dw13_EDF2, dw2_EFD


# ---- the sum over each token's rows as CSR x dense

# Rows per block where permute's backward and combine widen 16-bit [A, D] rows in cache rather than all at once
# (1024 x 512 fp32 = 2 MiB; S2's combine backward measured 10.7 ms at 512 rows, 11.1 at 1024, 15.5 at 4096).
WIDEN_BLOCK_ROWS = 1024


def _csr_matrix(crow, col, values, shape) -> torch.Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def csr_scatter_sum(src_AD, token_idx_A, weight_A, n_tokens: int, acc) -> torch.Tensor:
    """out[t] = sum over a with token_idx_A[a] == t of weight_A[a] * src_AD[a] -> [T, D] in `acc` (weight None
    = 1), as CSR x dense. Rows in `acc` are read where they lie; 16-bit rows are gathered in token order and
    widened a block of tokens at a time, in cache (S2's [32768, 512] bf16: 10.8 -> 7.8 ms against widening it
    whole first)."""
    n_rows = src_AD.shape[0]
    order_A = torch.argsort(token_idx_A, stable=True)  # rows in token order
    crow_T1 = torch.zeros(n_tokens + 1, dtype=torch.int64)
    torch.cumsum(count_ids(token_idx_A, n_tokens), 0, out=crow_T1[1:])
    values_A = torch.ones(n_rows, dtype=acc) if weight_A is None else weight_A.to(acc)[order_A]
    if src_AD.dtype == acc:
        return torch.sparse.mm(_csr_matrix(crow_T1, order_A, values_A, (n_tokens, n_rows)), src_AD)
    out_TD = src_AD.new_empty(n_tokens, src_AD.shape[1], dtype=acc)
    tokens_per_block = max(1, WIDEN_BLOCK_ROWS * n_tokens // n_rows)
    block_starts = list(range(0, n_tokens, tokens_per_block)) + [n_tokens]
    row_starts = crow_T1[block_starts].tolist()  # one host sync (a dry run's fake rows take index_add instead)
    local_col = torch.arange(n_rows)
    for t0, t1, r0, r1 in zip(block_starts[:-1], block_starts[1:], row_starts[:-1], row_starts[1:]):
        if r1 == r0:  # no token of the block kept a row (capacity drops)
            out_TD[t0:t1].zero_()
            continue
        rows_RD = src_AD.index_select(0, order_A[r0:r1]).to(acc)  # [R, D], this block's rows in token order
        block = _csr_matrix(crow_T1[t0 : t1 + 1] - r0, local_col[: r1 - r0], values_A[r0:r1], (t1 - t0, r1 - r0))
        torch.mm(block, rows_RD, out=out_TD[t0:t1])  # in place: no zeroed product copied over
    return out_TD
