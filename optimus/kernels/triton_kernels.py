"""Portable Triton kernels for the expert path (no vendor intrinsics).

Grouped GEMMs work on rows sorted by expert: expert e owns rows [offsets[e-1], offsets[e]).
Row tiles never straddle two experts; each program finds its (expert, row tile) by walking
the offsets, so BLOCK_M can be autotuned and experts may own zero rows. The grid has
cdiv(A, BLOCK_M) + E row tiles, an upper bound; programs without a tile exit at once.

Kernels:
  _grouped_gemm_kernel    y[rows of e] = x[rows of e] @ w[e]   (forward and input grad; any strides)
  _swiglu_fwd_kernel      h13 = x @ w13[e]; h = silu(gate) * up, fused in the epilogue
  _swiglu_bwd_kernel      dh = dy @ w2[e]^T, then d gate / d up from h13, fused in the epilogue
  _grouped_wgrad_kernel   dw[e] = x[rows of e]^T @ g[rows of e]   (or dw[e] += ..., into an fp32 buffer)
  _gather_rows_kernel     out[a] = src[idx[a]]                       (permute)
  _segment_sum_kernel     out[t] = sum_{a of t} w[a] * src[a]        (combine, permute backward)
  _combine_bwd_kernel     dy[a] = w[a] * dout[t(a)], dw[a] = <dout[t(a)], y[a]>
  _row_dot_kernel         out[n] = sum_d a[n, d] * b[n, d] (* w[d])   (RMSNorm's sums, where other ranks add theirs)
  _rms_norm_fwd_kernel    y = x * rsqrt(sum x^2 / width + eps) * w, in fp32, one pass over a tile of rows
  _rms_norm_bwd_kernel    dx, and each tile of rows' share of dw, in fp32
  _rope_kernel            out = (x1 cos - x2 sin, x2 cos + x1 sin) per row of a head, in fp32 (RoPE; -sin: its gradient)

Autotune configs are a list per vendor (NVIDIA, AMD, Intel XPU), picked from the device.
"""

import os

import torch
import triton
import triton.language as tl


def vendor() -> str:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreter"
    if torch.version.hip:
        return "amd"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "intel"
    return "nvidia"


def _cfg(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


# Tiles per vendor. Intel PVC's grouped GEMM runs best with large 256x256x32 tiles and 32 warps
# (its XMX engines are fed by big sub-group tiles); NVIDIA and AMD prefer 64-128 wide tiles.
# The interpreter gets one tiny tile so small test shapes still span several tiles.
_GEMM_CONFIGS = {
    "nvidia": [
        _cfg(128, 128, 64, 8, 3),
        _cfg(128, 128, 32, 4, 4),
        _cfg(128, 64, 64, 4, 4),
        _cfg(64, 128, 64, 4, 4),
        _cfg(64, 64, 64, 4, 3),
    ],
    "amd": [
        _cfg(128, 128, 64, 8, 2),
        _cfg(256, 128, 32, 8, 2),
        _cfg(128, 64, 64, 4, 2),
        _cfg(64, 128, 64, 4, 2),
        _cfg(64, 64, 64, 4, 2),
    ],
    "intel": [
        _cfg(256, 256, 32, 32, 2),
        _cfg(128, 256, 32, 32, 2),
        _cfg(128, 128, 32, 16, 2),
        _cfg(64, 128, 32, 8, 2),
    ],
    "interpreter": [_cfg(16, 16, 16, 1, 1)],
}


def gemm_configs() -> list:
    return _GEMM_CONFIGS[vendor()]


@triton.jit
def _expert_tile(pid_m, offsets_ptr, E, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of row tile pid_m; expert -1 when pid_m is past the last tile."""
    zero = pid_m * 0  # int32 scalars, so the loop-carried values keep one type
    expert = zero - 1
    row0 = zero
    row_end = zero
    tiles_before = zero
    start = zero
    for e in range(0, E):
        end = tl.load(offsets_ptr + e)
        n_tiles = tl.cdiv(end - start, BLOCK_M)
        hit = (pid_m >= tiles_before) & (pid_m < tiles_before + n_tiles)
        expert = tl.where(hit, e, expert)
        row0 = tl.where(hit, start + (pid_m - tiles_before) * BLOCK_M, row0)
        row_end = tl.where(hit, end, row_end)
        tiles_before += n_tiles
        start = end
    return expert, row0, row_end


@triton.jit
def _tile_rows_cols(row0, row_end, expert, w_ptr, swe, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows, row_mask, cols, col_mask, w_e) of an expert's tile: rows in int64 (a row times its stride can pass
    2^31), columns of program_id(1), their masks, and w offset to the expert."""
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, rows < row_end, cols, cols < N, w_ptr + expert.to(tl.int64) * swe


@triton.jit
def _tile_dot(
    x_ptr, w_ptr, rows, row_mask, cols, col_mask, K, sxm, sxk, swk, swn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N] = x[rows, :K] @ w[:K, cols] (w already offset to its expert)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            x_ptr + rows[:, None] * sxm + ks[None, :] * sxk, mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        b = tl.load(
            w_ptr + ks[:, None] * swk + cols[None, :] * swn, mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.autotune(configs=gemm_configs(), key=["N", "K"])
@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr, E, N, K,
    sxm, sxk, swe, swk, swn, sym, syn,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    expert, row0, row_end = _expert_tile(tl.program_id(0), offsets_ptr, E, BLOCK_M)
    if expert >= 0:
        rows, row_mask, cols, col_mask, w_e = _tile_rows_cols(row0, row_end, expert, w_ptr, swe, N, BLOCK_M, BLOCK_N)
        acc = _tile_dot(
            x_ptr, w_e, rows, row_mask, cols, col_mask, K, sxm, sxk, swk, swn, BLOCK_M, BLOCK_N, BLOCK_K, PREC
        )
        mask = row_mask[:, None] & col_mask[None, :]
        tl.store(y_ptr + rows[:, None] * sym + cols[None, :] * syn, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=gemm_configs(), key=["F", "K"])
@triton.jit
def _swiglu_fwd_kernel(
    x_ptr, w_ptr, h13_ptr, h_ptr, offsets_ptr, E, F, K,
    sxm, sxk, swe, swk, swn,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # h13 and h are contiguous: [A, 2F] and [A, F].
    expert, row0, row_end = _expert_tile(tl.program_id(0), offsets_ptr, E, BLOCK_M)
    if expert >= 0:
        rows, row_mask, cols, col_mask, w_e = _tile_rows_cols(row0, row_end, expert, w_ptr, swe, F, BLOCK_M, BLOCK_N)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # one pass over x feeds both the gate and the up tile
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(
                x_ptr + rows[:, None] * sxm + ks[None, :] * sxk, mask=row_mask[:, None] & k_mask[None, :], other=0.0
            )
            b_mask = k_mask[:, None] & col_mask[None, :]
            b_ptrs = w_e + ks[:, None] * swk + cols[None, :] * swn
            gate = tl.dot(a, tl.load(b_ptrs, mask=b_mask, other=0.0), gate, input_precision=PREC)
            up = tl.dot(a, tl.load(b_ptrs + F * swn, mask=b_mask, other=0.0), up, input_precision=PREC)
        out_ty = h_ptr.dtype.element_ty
        gate, up = gate.to(out_ty).to(tl.float32), up.to(out_ty).to(tl.float32)  # what backward will read
        h = gate * tl.sigmoid(gate) * up
        mask = row_mask[:, None] & col_mask[None, :]
        h13_ptrs = h13_ptr + rows[:, None] * (2 * F) + cols[None, :]
        tl.store(h13_ptrs, gate.to(out_ty), mask=mask)
        tl.store(h13_ptrs + F, up.to(out_ty), mask=mask)
        tl.store(h_ptr + rows[:, None] * F + cols[None, :], h.to(out_ty), mask=mask)


@triton.autotune(configs=gemm_configs(), key=["F", "K"])
@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr, w_ptr, h13_ptr, dh13_ptr, offsets_ptr, E, F, K,
    sdm, sdk, swe, swk, swn,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # dh = dy @ w2[e]^T (w strides given transposed), then through h = silu(gate) * up.
    expert, row0, row_end = _expert_tile(tl.program_id(0), offsets_ptr, E, BLOCK_M)
    if expert >= 0:
        rows, row_mask, cols, col_mask, w_e = _tile_rows_cols(row0, row_end, expert, w_ptr, swe, F, BLOCK_M, BLOCK_N)
        dh = _tile_dot(
            dy_ptr, w_e, rows, row_mask, cols, col_mask, K, sdm, sdk, swk, swn, BLOCK_M, BLOCK_N, BLOCK_K, PREC
        )
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows[:, None] * (2 * F) + cols[None, :]
        gate = tl.load(h13_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h13_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        d_up = dh * gate * sig
        d_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))
        out_ty = dh13_ptr.dtype.element_ty
        tl.store(dh13_ptr + offs, d_gate.to(out_ty), mask=mask)
        tl.store(dh13_ptr + offs + F, d_up.to(out_ty), mask=mask)


# restore_value: the autotuner runs each config on the real arguments; an accumulating call must not add once per
# config tried.
@triton.autotune(configs=gemm_configs(), key=["M", "N", "ACCUMULATE", "TWO_PARTS"], restore_value=["dw_ptr"])
@triton.jit
def _grouped_wgrad_kernel(
    x_ptr, g_ptr, offsets_ptr, x2_ptr, g2_ptr, offsets2_ptr, dw_ptr, M, N,
    sxa, sxm, sga, sgn, sx2a, sx2m, sg2a, sg2n, sde, sdm, sdn,
    PREC: tl.constexpr, ACCUMULATE: tl.constexpr, TWO_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # dw[e][M, N] = x[rows of e][:, M]^T @ g[rows of e][:, N]; BLOCK_K walks the expert's rows. TWO_PARTS: plus the
    # same over the second part's rows (x2, g2, offsets2: another batch of rows for the same weights), summed in the
    # same fp32 tile. ACCUMULATE: dw[e] (fp32) += the sum, taken in fp32 before any rounding.
    expert = tl.program_id(0)
    n_col_tiles = tl.cdiv(N, BLOCK_N)
    ms = (tl.program_id(1) // n_col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (tl.program_id(1) % n_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = ms < M, ns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _wgrad_rows(acc, x_ptr, g_ptr, offsets_ptr, expert, ms, ns, m_mask, n_mask, sxa, sxm, sga, sgn, PREC, BLOCK_K)
    if TWO_PARTS:
        acc = _wgrad_rows(
            acc, x2_ptr, g2_ptr, offsets2_ptr, expert, ms, ns, m_mask, n_mask, sx2a, sx2m, sg2a, sg2n, PREC, BLOCK_K
        )
    dw_ptrs = dw_ptr + expert.to(tl.int64) * sde + ms[:, None] * sdm + ns[None, :] * sdn
    if ACCUMULATE:
        acc += tl.load(dw_ptrs, mask=m_mask[:, None] & n_mask[None, :], other=0.0)
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _wgrad_rows(
    acc, x_ptr, g_ptr, offsets_ptr, expert, ms, ns, m_mask, n_mask, sxa, sxm, sga, sgn,
    PREC: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # acc [BLOCK_M, BLOCK_N] += x[rows of expert][:, ms]^T @ g[rows of expert][:, ns]
    start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.load(offsets_ptr + expert)
    for r0 in range(start, end, BLOCK_K):
        rs = (r0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        r_mask = rs < end
        a = tl.load(x_ptr + rs[None, :] * sxa + ms[:, None] * sxm, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(g_ptr + rs[:, None] * sga + ns[None, :] * sgn, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    # src and out contiguous [*, D]; one program per (output row, D block).
    row = tl.program_id(0).to(tl.int64)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    src_row = tl.load(idx_ptr + row).to(tl.int64)
    vals = tl.load(src_ptr + src_row * D + ds, mask=ds < D)
    tl.store(out_ptr + row * D + ds, vals.to(out_ptr.dtype.element_ty), mask=ds < D)


@triton.jit
def _segment_sum_kernel(
    src_ptr, order_ptr, seg_end_ptr, w_ptr, out_ptr, D, HAS_WEIGHT: tl.constexpr, BLOCK_D: tl.constexpr
):
    # out[t] = sum over j in segment t of w[order[j]] * src[order[j]], accumulated in fp32, no atomics.
    t = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(seg_end_ptr + t - 1, mask=t > 0, other=0)
    end = tl.load(seg_end_ptr + t)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(start, end):
        a = tl.load(order_ptr + j).to(tl.int64)
        row = tl.load(src_ptr + a * D + ds, mask=ds < D, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            row = row * tl.load(w_ptr + a).to(tl.float32)
        acc += row
    tl.store(out_ptr + t.to(tl.int64) * D + ds, acc.to(out_ptr.dtype.element_ty), mask=ds < D)


@triton.jit
def _combine_bwd_kernel(dout_ptr, y_ptr, idx_ptr, w_ptr, dy_ptr, dw_ptr, D, BLOCK_D: tl.constexpr):
    # One program per assignment a: dy[a] = w[a] * dout[t], dw[a] = <dout[t], y[a]>.
    a = tl.program_id(0).to(tl.int64)
    t = tl.load(idx_ptr + a).to(tl.int64)
    w = tl.load(w_ptr + a).to(tl.float32)
    dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        g = tl.load(dout_ptr + t * D + ds, mask=ds < D, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + a * D + ds, mask=ds < D, other=0.0).to(tl.float32)
        tl.store(dy_ptr + a * D + ds, (w * g).to(dy_ptr.dtype.element_ty), mask=ds < D)
        dot += g * y
    tl.store(dw_ptr + a, tl.sum(dot, axis=0).to(dw_ptr.dtype.element_ty))


# RMSNorm works on tiles of BLOCK_R whole rows, walking the width in BLOCK_D columns: a first walk sums over each
# row (unless the sums come in, added up over the ranks that split the width), a second writes. The second walk
# rereads what the first read, from the cache when a tile's rows fit in it.


@triton.jit
def _row_dot_kernel(
    a_ptr, b_ptr, w_ptr, out_ptr, N, D, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        tile = rows.to(tl.int64)[:, None] * D + ds[None, :]
        ok = row_ok[:, None] & (ds < D)[None, :]
        prod = tl.load(a_ptr + tile, mask=ok, other=0.0).to(tl.float32) * tl.load(b_ptr + tile, mask=ok, other=0.0).to(
            tl.float32
        )
        if HAS_W:
            prod = prod * tl.load(w_ptr + ds, mask=ds < D, other=0.0).to(tl.float32)[None, :]
        acc += tl.sum(prod, axis=1)
    tl.store(out_ptr + rows, acc, mask=row_ok)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, sumsq_ptr, y_ptr, rstd_ptr, N, D, inv_width, eps,
    HAS_SUMSQ: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    if HAS_SUMSQ:
        sumsq = tl.load(sumsq_ptr + rows, mask=row_ok, other=0.0)
    else:
        sumsq = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            ok = row_ok[:, None] & (ds < D)[None, :]
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + ds[None, :], mask=ok, other=0.0).to(tl.float32)
            sumsq += tl.sum(x * x, axis=1)
    rstd = tl.rsqrt(sumsq * inv_width + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        tile = rows.to(tl.int64)[:, None] * D + ds[None, :]
        ok = row_ok[:, None] & (ds < D)[None, :]
        x = tl.load(x_ptr + tile, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ds, mask=ds < D, other=0.0).to(tl.float32)
        tl.store(y_ptr + tile, (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_bwd_kernel(
    g_ptr, x_ptr, w_ptr, rstd_ptr, dot_ptr, dx_ptr, dw_part_ptr, N, D, inv_width,
    HAS_DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # n = x * rstd, dx = rstd * (g * w - n * mean(g * w * n)); dw_part[tile] = sum over the tile's rows of g * n.
    tile_id = tl.program_id(0)
    rows = tile_id * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    if HAS_DOT:  # sum over the row of g * w * x, added up over the ranks that split the width
        dot = tl.load(dot_ptr + rows, mask=row_ok, other=0.0)
    else:
        dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            tile = rows.to(tl.int64)[:, None] * D + ds[None, :]
            ok = row_ok[:, None] & (ds < D)[None, :]
            g = tl.load(g_ptr + tile, mask=ok, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + tile, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + ds, mask=ds < D, other=0.0).to(tl.float32)
            dot += tl.sum(g * w[None, :] * x, axis=1)
    mean = dot * rstd * inv_width  # mean of g * w * n over the whole width
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        tile = rows.to(tl.int64)[:, None] * D + ds[None, :]
        ok = row_ok[:, None] & (ds < D)[None, :]
        g = tl.load(g_ptr + tile, mask=ok, other=0.0).to(tl.float32)
        n = tl.load(x_ptr + tile, mask=ok, other=0.0).to(tl.float32) * rstd[:, None]
        w = tl.load(w_ptr + ds, mask=ds < D, other=0.0).to(tl.float32)
        dx = rstd[:, None] * (g * w[None, :] - n * mean[:, None])
        tl.store(dx_ptr + tile, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        tl.store(dw_part_ptr + tile_id.to(tl.int64) * D + ds, tl.sum(g * n, axis=0), mask=ds < D)


# RoPE works on tiles of rows, a row being one (batch, head, position)'s head dimension: the input is read through
# its strides (a transposed projection's), the output written contiguous.


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, R, N, S, stride_b, stride_n, stride_s, HALF,
    INVERSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    pos = rows % S
    x_row = (rows // (S * N)) * stride_b + ((rows // S) % N) * stride_n + pos * stride_s
    cols = tl.arange(0, BLOCK_H)
    ok = row_ok[:, None] & (cols < HALF)[None, :]
    x1 = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row[:, None] + HALF + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    table = pos[:, None] * HALF + cols[None, :]
    cos = tl.load(cos_ptr + table, mask=ok, other=0.0)
    sin = tl.load(sin_ptr + table, mask=ok, other=0.0)
    if INVERSE:
        sin = -sin
    out_row = rows[:, None] * (2 * HALF) + cols[None, :]
    tl.store(out_ptr + out_row, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + out_row + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=ok)


# ---- launchers (shapes checked by the callers in triton_backend) ----


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs: IEEE fp32 dots unless torch allows TF32 (fp32 runs must match the fp32 oracle).
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and vendor() == "nvidia":
        return "tf32"
    return "ieee"


def _block_d(D: int) -> int:
    return min(triton.next_power_of_2(D), 1024)


def grouped_gemm(x_AK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e]; w may be any strided view (e.g. a transpose). -> [A, N]."""
    A, K = x_AK.shape
    E, _, N = w_EKN.shape
    y_AN = x_AK.new_empty(A, N)
    grid = lambda meta: (triton.cdiv(A, meta["BLOCK_M"]) + E, triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    _grouped_gemm_kernel[grid](
        x_AK, w_EKN, y_AN, offsets_E, E, N, K,
        *x_AK.stride(), *w_EKN.stride(), *y_AN.stride(), PREC=_prec(x_AK.dtype),
    )  # fmt: skip
    return y_AN


def swiglu_forward(x_AD: torch.Tensor, w13_EDF2: torch.Tensor, offsets_E: torch.Tensor):
    """(h13 = x @ w13[e] -> [A, 2F], h = silu(gate) * up -> [A, F])."""
    A, D = x_AD.shape
    E, _, F2 = w13_EDF2.shape
    F = F2 // 2
    h13_AF2 = x_AD.new_empty(A, F2)
    h_AF = x_AD.new_empty(A, F)
    grid = lambda meta: (triton.cdiv(A, meta["BLOCK_M"]) + E, triton.cdiv(F, meta["BLOCK_N"]))  # noqa: E731
    _swiglu_fwd_kernel[grid](
        x_AD, w13_EDF2, h13_AF2, h_AF, offsets_E, E, F, D,
        *x_AD.stride(), *w13_EDF2.stride(), PREC=_prec(x_AD.dtype),
    )  # fmt: skip
    return h13_AF2, h_AF


def swiglu_backward(dy_AD: torch.Tensor, w2_EFD: torch.Tensor, h13_AF2: torch.Tensor, offsets_E: torch.Tensor):
    """[d gate | d up] -> [A, 2F] from dy and the saved h13."""
    A, D = dy_AD.shape
    E, F, _ = w2_EFD.shape
    dh13_AF2 = torch.empty_like(h13_AF2)
    w2_t = w2_EFD.transpose(1, 2)  # [E, D, F] view
    grid = lambda meta: (triton.cdiv(A, meta["BLOCK_M"]) + E, triton.cdiv(F, meta["BLOCK_N"]))  # noqa: E731
    _swiglu_bwd_kernel[grid](
        dy_AD, w2_t, h13_AF2, dh13_AF2, offsets_E, E, F, D,
        *dy_AD.stride(), *w2_t.stride(), PREC=_prec(dy_AD.dtype),
    )  # fmt: skip
    return dh13_AF2


# (x [A, M], g [A, N], offsets [E]): a batch of expert-sorted rows and the end of each expert's
WgradPart = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def grouped_wgrad(
    x_AM: torch.Tensor, g_AN: torch.Tensor, offsets_E: torch.Tensor, dtype: torch.dtype, second: WgradPart | None = None
) -> torch.Tensor:
    """dw[e] = x[rows of e]^T @ g[rows of e] -> [E, M, N] in `dtype` (zero for experts without rows); with `second`
    (a WgradPart of other rows for the same weights), the sum of both parts' products, rounded once."""
    dw_EMN = x_AM.new_empty(offsets_E.shape[0], x_AM.shape[1], g_AN.shape[1], dtype=dtype)
    _launch_wgrad((x_AM, g_AN, offsets_E), second, dw_EMN, accumulate=False)
    return dw_EMN


def grouped_wgrad_into(
    x_AM: torch.Tensor, g_AN: torch.Tensor, offsets_E: torch.Tensor, sum_EMN: torch.Tensor,
    second: WgradPart | None = None,
) -> None:  # fmt: skip
    """sum[e] += x[rows of e]^T @ g[rows of e] (plus the same of `second`'s rows) in place; `sum_EMN` fp32 [E, M, N]
    (gradient-accumulation fusion), read and written once whether one part is added or two."""
    if sum_EMN.dtype != torch.float32 or sum_EMN.shape != (offsets_E.shape[0], x_AM.shape[1], g_AN.shape[1]):
        raise ValueError(f"grouped_wgrad_into adds into an fp32 [E, M, N] tensor, not {sum_EMN.dtype} {sum_EMN.shape}")
    _launch_wgrad((x_AM, g_AN, offsets_E), second, sum_EMN, accumulate=True)


def _launch_wgrad(first: WgradPart, second: WgradPart | None, dw_EMN: torch.Tensor, accumulate: bool) -> None:
    x_AM, g_AN, offsets_E = first
    x2_AM, g2_AN, offsets2_E = second if second is not None else first  # unread without TWO_PARTS
    if x2_AM.shape[1:] != x_AM.shape[1:] or g2_AN.shape[1:] != g_AN.shape[1:] or offsets2_E.shape != offsets_E.shape:
        raise ValueError("the two parts of a grouped weight gradient must be rows for the same weights")
    M, N = x_AM.shape[1], g_AN.shape[1]
    grid = lambda meta: (offsets_E.shape[0], triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    _grouped_wgrad_kernel[grid](
        x_AM, g_AN, offsets_E, x2_AM, g2_AN, offsets2_E, dw_EMN, M, N,
        *x_AM.stride(), *g_AN.stride(), *x2_AM.stride(), *g2_AN.stride(), *dw_EMN.stride(),
        PREC=_prec(x_AM.dtype), ACCUMULATE=accumulate, TWO_PARTS=second is not None,
    )  # fmt: skip


def gather_rows(src_ND: torch.Tensor, idx_A: torch.Tensor) -> torch.Tensor:
    """out[a] = src[idx[a]] -> [A, D]."""
    src_ND = src_ND.contiguous()
    D = src_ND.shape[1]
    out_AD = src_ND.new_empty(idx_A.shape[0], D)
    if out_AD.numel():
        block = _block_d(D)
        _gather_rows_kernel[(idx_A.shape[0], triton.cdiv(D, block))](src_ND, idx_A, out_AD, D, BLOCK_D=block)
    return out_AD


def segment_sum(src_AD, order_A, seg_end_T, weight_A, dtype) -> torch.Tensor:
    """out[t] = sum over j in [seg_end[t-1], seg_end[t]) of weight[order[j]] * src[order[j]] -> [T, D]."""
    src_AD = src_AD.contiguous()
    T, D = seg_end_T.shape[0], src_AD.shape[1]
    out_TD = src_AD.new_empty(T, D, dtype=dtype)
    if out_TD.numel():
        block = _block_d(D)
        w = weight_A if weight_A is not None else src_AD  # unused pointer when HAS_WEIGHT is False
        _segment_sum_kernel[(T, triton.cdiv(D, block))](
            src_AD, order_A, seg_end_T, w, out_TD, D, HAS_WEIGHT=weight_A is not None, BLOCK_D=block
        )
    return out_TD


def combine_backward(dout_TD, y_AD, idx_A, weight_A, y_dtype, w_dtype):
    """(dy[a] = w[a] * dout[idx[a]] -> [A, D], dw[a] = <dout[idx[a]], y[a]> -> [A])."""
    dout_TD, y_AD = dout_TD.contiguous(), y_AD.contiguous()
    A, D = y_AD.shape
    dy_AD = y_AD.new_empty(A, D, dtype=y_dtype)
    dw_A = weight_A.new_empty(A, dtype=w_dtype)
    if A:
        _combine_bwd_kernel[(A,)](dout_TD, y_AD, idx_A, weight_A, dy_AD, dw_A, D, BLOCK_D=min(_block_d(D), 256))
    return dy_AD, dw_A


def _norm_tiles(D: int) -> tuple[int, int]:
    """(rows, columns) of an RMSNorm tile: a few rows, the width in chunks of at most 1024 (the interpreter: 2 x 16,
    so that small test shapes span several tiles each way)."""
    if vendor() == "interpreter":
        return 2, 16
    block_d = _block_d(D)
    return max(1, 4096 // block_d), block_d


def row_dot(a_ND: torch.Tensor, b_ND: torch.Tensor, w_D: torch.Tensor | None) -> torch.Tensor:
    """out[n] = sum_d a[n, d] * b[n, d] (* w[d]) in fp32 -> [N]; a and b contiguous."""
    N, D = a_ND.shape
    out_N = a_ND.new_empty(N, dtype=torch.float32)
    if N:
        rows, cols = _norm_tiles(D)
        w = w_D if w_D is not None else a_ND  # unused pointer when HAS_W is False
        _row_dot_kernel[(triton.cdiv(N, rows),)](
            a_ND, b_ND, w, out_N, N, D, HAS_W=w_D is not None, BLOCK_R=rows, BLOCK_D=cols
        )
    return out_N


def rms_norm_forward(x_ND, w_D, eps: float, width: int, sumsq_N):
    """(y = x * rsqrt(sum x^2 / width + eps) * w -> [N, D] in x's dtype, rstd -> [N] fp32); `sumsq_N`: the rows' sums
    of squares over the whole width when other ranks hold part of it (None: x holds the whole width)."""
    N, D = x_ND.shape
    y_ND, rstd_N = torch.empty_like(x_ND), x_ND.new_empty(N, dtype=torch.float32)
    if N:
        rows, cols = _norm_tiles(D)
        _rms_norm_fwd_kernel[(triton.cdiv(N, rows),)](
            x_ND, w_D, sumsq_N if sumsq_N is not None else rstd_N, y_ND, rstd_N, N, D, 1.0 / width, eps,
            HAS_SUMSQ=sumsq_N is not None, BLOCK_R=rows, BLOCK_D=cols,
        )  # fmt: skip
    return y_ND, rstd_N


def rms_norm_backward(g_ND, x_ND, w_D, rstd_N, width: int, dot_N):
    """(dx -> [N, D] in x's dtype, dw -> [D] in w's dtype) of rms_norm_forward; `dot_N`: the rows' sums of
    g * w * x over the whole width when other ranks hold part of it (None: computed here)."""
    N, D = x_ND.shape
    rows, cols = _norm_tiles(D)
    dx_ND = torch.empty_like(x_ND)
    dw_part_PD = x_ND.new_empty(triton.cdiv(N, rows), D, dtype=torch.float32)  # each tile of rows' share
    if N:
        _rms_norm_bwd_kernel[(triton.cdiv(N, rows),)](
            g_ND, x_ND, w_D, rstd_N, dot_N if dot_N is not None else rstd_N, dx_ND, dw_part_PD, N, D, 1.0 / width,
            HAS_DOT=dot_N is not None, BLOCK_R=rows, BLOCK_D=cols,
        )  # fmt: skip
    return dx_ND, dw_part_PD.sum(0).to(w_D.dtype)


def rope(x_BNSH: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor, inverse: bool, dtype: torch.dtype):
    """x rotated by the tables' angles (their opposites where `inverse`) -> [B, N, S, H] contiguous in `dtype`; x
    any strides but a contiguous last dimension, cos and sin [S, H / 2] contiguous fp32."""
    B, N, S, H = x_BNSH.shape
    out = x_BNSH.new_empty((B, N, S, H), dtype=dtype)
    rows = B * N * S
    if rows:
        block_h = triton.next_power_of_2(H // 2)
        tile = 2 if vendor() == "interpreter" else max(1, 4096 // block_h)  # the interpreter: several tiles
        sb, sn, ss, _ = x_BNSH.stride()
        _rope_kernel[(triton.cdiv(rows, tile),)](
            x_BNSH, cos_SH, sin_SH, out, rows, N, S, sb, sn, ss, H // 2,
            INVERSE=inverse, BLOCK_R=tile, BLOCK_H=block_h,
        )  # fmt: skip
    return out


def forget_autotuning() -> None:
    """Drop each autotuned kernel's chosen configuration, so that its next call tunes again. Autotuning keys on the
    widths, not on the row count: a call on a few rows (the start-up check's) would otherwise fix the tiles that
    every later call, on a micro-batch's thousands of rows, runs with."""
    for kernel in (_grouped_gemm_kernel, _swiglu_fwd_kernel, _swiglu_bwd_kernel, _grouped_wgrad_kernel):
        kernel.cache.clear()
