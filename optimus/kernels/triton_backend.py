"""The Triton expert path: custom operators (namespace `optimus`) over the kernels in `triton_kernels`.

Each differentiable operation is a `torch.library.custom_op` with a fake implementation (its outputs' shapes,
dtypes and strides from its inputs' alone) and a registered backward built from further custom operators. So
the path runs on fake tensors (`FakeTensorMode`, a dry run), forward and backward, and torch.compile can trace
it without looking inside a kernel. A weight whose optimizer offers an fp32 gradient sink (optimus.kernels.grad_sink)
has its gradient added there by the weight-gradient kernel itself.

Imported only when the triton backend is chosen (it imports triton). Everything runs in the compute dtype
(autocast dtype under autocast, else the input's dtype) with fp32 accumulation; weight gradients come back in
the weights' own dtype. The casts into the compute dtype happen inside the operators, since an operator's
output may not alias its input and weight gradients are written in the weights' dtype straight from fp32.
Backward casts the saved inputs again: a copy only of what autocast narrows (the fp32 weights), which is not
held from forward to backward.

Token <-> assignment maps: permute's backward and combine's forward sum, for each token, its
assignments. They walk the assignments sorted by token (a stable argsort, so the sum order
is fixed), so no atomics are needed and results are deterministic.
"""

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from optimus.kernels import grad_sink
from optimus.kernels import triton_kernels as tk
from optimus.kernels.counting import count_ids
from optimus.kernels.dtypes import compute_dtype
from optimus.kernels.rms_norm import NormArithmetic
from optimus.kernels.torch_private import FakeTensor, needed_input_grads


def _token_segments(token_idx_A: Tensor, n_tokens: int):
    """(assignments sorted by token -> [A], cumulative end of each token's run -> [T], int32)."""
    order_A = torch.argsort(token_idx_A, stable=True)
    seg_end_T = torch.cumsum(count_ids(token_idx_A, n_tokens), 0)
    return order_A, seg_end_T.to(torch.int32)


def _check_rows(offsets_E: Tensor, n_rows: int) -> None:
    """On a CPU, where reading it costs nothing, the last offset must be the row count (the interpreted kernels
    would read past x's end). Fake tensors hold no value to check."""
    readable = offsets_E.device.type == "cpu" and not isinstance(offsets_E, FakeTensor)
    if offsets_E.numel() and readable and int(offsets_E[-1]) != n_rows:
        raise ValueError(f"offsets_E ends at {int(offsets_E[-1])} but x has {n_rows} rows; they must match.")


# ---- operators used by the backward passes (no autograd of their own) ----


@torch.library.custom_op("optimus::triton_segment_sum", mutates_args=())
def _segment_sum(src_AD: Tensor, order_A: Tensor, seg_end_T: Tensor, dtype: torch.dtype) -> Tensor:
    """out[t] = sum of src's rows of token t -> [T, D] in `dtype` (permute's backward)."""
    return tk.segment_sum(src_AD, order_A, seg_end_T, None, dtype)


@_segment_sum.register_fake
def _(src_AD, order_A, seg_end_T, dtype):
    return src_AD.new_empty(seg_end_T.shape[0], src_AD.shape[1], dtype=dtype)


@torch.library.custom_op("optimus::triton_combine_grads", mutates_args=())
def _combine_grads(
    dout_TD: Tensor, y_AD: Tensor, token_idx_A: Tensor, weight_A: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(d y -> [A, D] in y's dtype, d weight -> [A] in weight's dtype) of combine computed in `dtype`."""
    return tk.combine_backward(dout_TD, y_AD.to(dtype), token_idx_A, weight_A, y_AD.dtype, weight_A.dtype)


@_combine_grads.register_fake
def _(dout_TD, y_AD, token_idx_A, weight_A, dtype):
    return y_AD.new_empty(y_AD.shape), weight_A.new_empty(y_AD.shape[0])


@torch.library.custom_op("optimus::triton_swiglu_backward", mutates_args=())
def _swiglu_backward(dy_AD: Tensor, w2_EFD: Tensor, h13_AF2: Tensor, offsets_E: Tensor) -> Tensor:
    """[d gate | d up] -> [A, 2F] from dy (in the compute dtype), w2 and the saved h13."""
    return tk.swiglu_backward(dy_AD, w2_EFD.to(dy_AD.dtype), h13_AF2, offsets_E)


@_swiglu_backward.register_fake
def _(dy_AD, w2_EFD, h13_AF2, offsets_E):
    return torch.empty_like(h13_AF2)


@torch.library.custom_op("optimus::triton_grouped_wgrad", mutates_args=())
def _grouped_wgrad(
    x_AM: Tensor, g_AN: Tensor, offsets_E: Tensor, out_dtype: torch.dtype,
    x2_AM: Tensor | None = None, g2_AN: Tensor | None = None, offsets2_E: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """dw[e] = x[rows of e]^T @ g[rows of e] -> [E, M, N] in `out_dtype`, plus the same over a second part's rows
    (x2, g2, offsets2) where given. Not `dtype`: the products are in the inputs' dtype, whatever the output's (the
    performance model reads an operator's `dtype` as its compute dtype)."""
    return tk.grouped_wgrad(x_AM, g_AN, offsets_E, out_dtype, _second_part(x2_AM, g2_AN, offsets2_E))


@_grouped_wgrad.register_fake
def _(x_AM, g_AN, offsets_E, out_dtype, x2_AM=None, g2_AN=None, offsets2_E=None):
    return x_AM.new_empty(offsets_E.shape[0], x_AM.shape[1], g_AN.shape[1], dtype=out_dtype)


@torch.library.custom_op("optimus::triton_grouped_wgrad_into", mutates_args=("sum_EMN",))
def _grouped_wgrad_into(
    x_AM: Tensor, g_AN: Tensor, offsets_E: Tensor, sum_EMN: Tensor,
    x2_AM: Tensor | None = None, g2_AN: Tensor | None = None, offsets2_E: Tensor | None = None,
) -> None:  # fmt: skip
    """sum[e] += x[rows of e]^T @ g[rows of e] (and the same over a second part's rows where given) in fp32, in
    place (a weight's gradient sink: grad_sink), the sum read and written once."""
    tk.grouped_wgrad_into(x_AM, g_AN, offsets_E, sum_EMN, _second_part(x2_AM, g2_AN, offsets2_E))


@_grouped_wgrad_into.register_fake
def _(x_AM, g_AN, offsets_E, sum_EMN, x2_AM=None, g2_AN=None, offsets2_E=None):
    return None


def _second_part(x2_AM: Tensor | None, g2_AN: Tensor | None, offsets2_E: Tensor | None) -> tk.WgradPart | None:
    return None if x2_AM is None else (x2_AM, g2_AN, offsets2_E)


def _weight_grad(x_AM: Tensor, g_AN: Tensor, offsets_E: Tensor, w_EMN: Tensor) -> Tensor | None:
    """A grouped weight's gradient, returned in the weight's dtype; or, where the optimizer offers a sink
    (grad_sink.sink_of), added into its fp32 sum (or written in fp32 as the sum, where the step has none yet),
    with an uninitialised tensor returned in its place for the optimizer's hook to drop (None from a second use in
    the same backward: grad_sink.mark_added).

    Into a sink, a use's product waits for the weight's next use in the same backward (parallel.ep_overlap_chunks
    runs the experts on each chunk of a micro-batch's rows) and the two are added in one pass over the fp32 sum,
    which is memory-bound at a few hundred rows per expert: the sum is read and written once per pair of uses, not
    once per use. A use that finds no partner is added alone by the optimizer's hook, which runs once the
    backward has made every use's gradient (grad_sink.defer)."""
    sink = grad_sink.sink_of(w_EMN)
    if sink is None:
        return _grouped_wgrad(x_AM, g_AN, offsets_E, w_EMN.dtype)
    first_use = grad_sink.mark_added(w_EMN)
    part = (x_AM, g_AN, offsets_E)
    waiting = grad_sink.take_deferred(w_EMN)
    if waiting is None:
        grad_sink.defer(w_EMN, part, lambda: _add_to_sink(sink, part, None))
    else:
        _add_to_sink(sink, waiting, part)
    return torch.empty_like(w_EMN) if first_use else None


def _add_to_sink(sink: grad_sink.Sink, part: tk.WgradPart, second: tk.WgradPart | None) -> None:
    """Add one or two parts' products to the sink's fp32 sum, or write them as the sum where the step has none."""
    extra = second if second is not None else (None, None, None)
    total = sink.sum()
    if total is None:
        sink.adopt(_grouped_wgrad(*part, torch.float32, *extra))
    else:
        _grouped_wgrad_into(*part, total, *extra)


# ---- the differentiable operators ----


@torch.library.custom_op("optimus::triton_permute", mutates_args=())
def _permute(x_TD: Tensor, token_idx_A: Tensor, dtype: torch.dtype) -> Tensor:
    """x_AD[a] = x_TD[token_idx_A[a]] in `dtype`."""
    return tk.gather_rows(x_TD.to(dtype), token_idx_A)


@_permute.register_fake
def _(x_TD, token_idx_A, dtype):
    return x_TD.new_empty(token_idx_A.shape[0], x_TD.shape[1], dtype=dtype)


def _permute_setup(ctx, inputs, output):
    x_TD, token_idx_A, _ = inputs
    ctx.save_for_backward(token_idx_A)
    ctx.n_tokens, ctx.x_dtype = x_TD.shape[0], x_TD.dtype


def _permute_backward(ctx, dy_AD):
    (token_idx_A,) = ctx.saved_tensors
    order_A, seg_end_T = _token_segments(token_idx_A, ctx.n_tokens)
    return _segment_sum(dy_AD, order_A, seg_end_T, ctx.x_dtype), None, None


_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("optimus::triton_combine", mutates_args=())
def _combine(y_AD: Tensor, token_idx_A: Tensor, weight_A: Tensor, n_tokens: int, dtype: torch.dtype) -> Tensor:
    """out[t] = sum over assignments a of token t of weight_A[a] * y_AD[a] -> [T, D] in `dtype`."""
    order_A, seg_end_T = _token_segments(token_idx_A, n_tokens)
    return tk.segment_sum(y_AD.to(dtype), order_A, seg_end_T, weight_A, dtype)


@_combine.register_fake
def _(y_AD, token_idx_A, weight_A, n_tokens, dtype):
    return y_AD.new_empty(n_tokens, y_AD.shape[1], dtype=dtype)


def _combine_setup(ctx, inputs, output):
    y_AD, token_idx_A, weight_A, _, dtype = inputs
    ctx.save_for_backward(y_AD, token_idx_A, weight_A)
    ctx.dtype = dtype


def _combine_backward(ctx, dout_TD):
    y_AD, token_idx_A, weight_A = ctx.saved_tensors
    dy_AD, dw_A = _combine_grads(dout_TD, y_AD, token_idx_A, weight_A, ctx.dtype)
    return dy_AD, None, dw_A, None, None


_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


@torch.library.custom_op("optimus::triton_swiglu_mlp", mutates_args=())
def _swiglu_mlp(
    x_AD: Tensor, w13_EDF2: Tensor, w2_EFD: Tensor, offsets_E: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """(y [A, D], h13 = x @ w13[e] [A, 2F], h = silu(gate) * up [A, F]), all in `dtype`; h13 and h are returned
    for the backward, which recomputes nothing."""
    h13_AF2, h_AF = tk.swiglu_forward(x_AD.to(dtype), w13_EDF2.to(dtype), offsets_E)
    return tk.grouped_gemm(h_AF, w2_EFD.to(dtype), offsets_E), h13_AF2, h_AF


@_swiglu_mlp.register_fake
def _(x_AD, w13_EDF2, w2_EFD, offsets_E, dtype):
    n_rows, n_ffn2 = x_AD.shape[0], w13_EDF2.shape[2]
    y_AD = x_AD.new_empty(n_rows, w2_EFD.shape[2], dtype=dtype)
    return y_AD, x_AD.new_empty(n_rows, n_ffn2, dtype=dtype), x_AD.new_empty(n_rows, n_ffn2 // 2, dtype=dtype)


def _swiglu_mlp_setup(ctx, inputs, output):
    x_AD, w13_EDF2, w2_EFD, offsets_E, dtype = inputs
    _, h13_AF2, h_AF = output
    ctx.mark_non_differentiable(h13_AF2, h_AF)
    ctx.set_materialize_grads(False)  # no zero gradients for h13 and h, which nothing downstream uses
    ctx.save_for_backward(x_AD, w13_EDF2, w2_EFD, offsets_E, h13_AF2, h_AF)
    ctx.dtype = dtype
    ctx.weights = (w13_EDF2, w2_EFD)  # the parameter objects, whose sinks the backward asks for and marks
    ctx.kept_dh13 = None  # zero bubble: (dy, the input pass's inner gradient from it), kept for the weight pass


def _swiglu_mlp_backward(ctx, dy_AD, _dh13, _dh):
    x_AD, w13_EDF2, w2_EFD, offsets_E, h13_AF2, h_AF = ctx.saved_tensors
    dy_c = dy_AD.to(ctx.dtype)
    dx_AD = dw13 = dw2 = None
    needs_x, needs_w13, needs_w2 = needed_input_grads(ctx)[:3]  # under zero bubble, one pass's
    # The inner gradient [A, 2F] (a GEMM with w2 and SwiGLU's derivative), which dx and w13's gradient need: zero
    # bubble's input pass keeps it on ctx for the weight pass, which would otherwise compute it again (w2's gradient
    # needs only h and dy); used only by a backward of weights alone with the same dy (torch's weight pass sends the
    # dy its input pass got). Kept until then: optimus.plan counts it per input pass whose weight pass is pending.
    kept, ctx.kept_dh13 = ctx.kept_dh13, None
    dh13_AF2 = kept[1] if kept is not None and not needs_x and kept[0] is dy_AD else None
    if dh13_AF2 is None and (needs_x or needs_w13):
        dh13_AF2 = _swiglu_backward(dy_c, w2_EFD, h13_AF2, offsets_E)  # [A, 2F]
    if needs_x and not (needs_w13 or needs_w2) and ctx.needs_input_grad[1]:  # a weight pass follows
        ctx.kept_dh13 = (dy_AD, dh13_AF2)
    if needs_x:
        dx_AD = _grouped_mm(dh13_AF2, w13_EDF2.transpose(1, 2), offsets_E, ctx.dtype).to(x_AD.dtype)
    if needs_w13:
        dw13 = _weight_grad(x_AD.to(ctx.dtype), dh13_AF2, offsets_E, ctx.weights[0])  # [E, D, 2F]
    if needs_w2:
        dw2 = _weight_grad(h_AF, dy_c, offsets_E, ctx.weights[1])  # [E, F, D]
    return dx_AD, dw13, dw2, None, None


_swiglu_mlp.register_autograd(_swiglu_mlp_backward, setup_context=_swiglu_mlp_setup)


@torch.library.custom_op("optimus::triton_grouped_mm", mutates_args=())
def _grouped_mm(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor, dtype: torch.dtype) -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e] -> [A, N] in `dtype`; w may be any strided view (e.g. a transpose)."""
    return tk.grouped_gemm(x_AK.to(dtype), w_EKN.to(dtype), offsets_E)


@_grouped_mm.register_fake
def _(x_AK, w_EKN, offsets_E, dtype):
    return x_AK.new_empty(x_AK.shape[0], w_EKN.shape[2], dtype=dtype)


def _grouped_mm_setup(ctx, inputs, output):
    x_AK, w_EKN, offsets_E, dtype = inputs
    ctx.save_for_backward(x_AK, w_EKN, offsets_E)
    ctx.dtype = dtype
    ctx.weight = w_EKN  # the parameter object, whose sink the backward asks for and marks


def _grouped_mm_backward(ctx, dy_AN):
    x_AK, w_EKN, offsets_E = ctx.saved_tensors
    dy_c = dy_AN.to(ctx.dtype)
    dx = dw = None
    needs_x, needs_w = needed_input_grads(ctx)[:2]  # under zero bubble, one pass's
    if needs_x:  # input grad: dy @ w[e]^T, the forward kernel on a transposed view
        dx = _grouped_mm(dy_c, w_EKN.transpose(1, 2), offsets_E, ctx.dtype).to(x_AK.dtype)
    if needs_w:
        dw = _weight_grad(x_AK.to(ctx.dtype), dy_c, offsets_E, ctx.weight)
    return dx, dw, None, None


_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


# ---- RMSNorm's arithmetic (optimus.kernels.rms_norm, whose autograd.Function calls these; no autograd here) ----


@torch.library.custom_op("optimus::triton_row_dot", mutates_args=())
def _row_dot(a_ND: Tensor, b_ND: Tensor, w_D: Tensor | None) -> Tensor:
    """out[n] = sum over the columns of a * b (* w) -> [N] fp32."""
    return tk.row_dot(a_ND, b_ND, w_D)


@_row_dot.register_fake
def _(a_ND, b_ND, w_D):
    return a_ND.new_empty(a_ND.shape[0], dtype=torch.float32)


@torch.library.custom_op("optimus::triton_rms_norm", mutates_args=())
def _rms_norm(x_ND: Tensor, w_D: Tensor, eps: float, width: int, sumsq_N: Tensor | None) -> tuple[Tensor, Tensor]:
    """(y -> [N, D] in x's dtype, rstd -> [N] fp32): optimus.kernels.rms_norm.NormArithmetic.forward."""
    return tk.rms_norm_forward(x_ND, w_D, eps, width, sumsq_N)


@_rms_norm.register_fake
def _(x_ND, w_D, eps, width, sumsq_N):
    return torch.empty_like(x_ND), x_ND.new_empty(x_ND.shape[0], dtype=torch.float32)


@torch.library.custom_op("optimus::triton_rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    g_ND: Tensor, x_ND: Tensor, w_D: Tensor, rstd_N: Tensor, width: int, dot_N: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(dx -> [N, D] in x's dtype, dw -> [D] in w's dtype): optimus.kernels.rms_norm.NormArithmetic.backward."""
    return tk.rms_norm_backward(g_ND, x_ND, w_D, rstd_N, width, dot_N)


@_rms_norm_backward.register_fake
def _(g_ND, x_ND, w_D, rstd_N, width, dot_N):
    return torch.empty_like(x_ND), torch.empty_like(w_D)


RMS_NORM = NormArithmetic("triton", _row_dot, _rms_norm, _rms_norm_backward)


# ---- RoPE's rotation (optimus.kernels.rope, whose autograd.Function calls it both ways) ----


@torch.library.custom_op("optimus::triton_rope", mutates_args=())
def _rope(x_BNSH: Tensor, cos_SH: Tensor, sin_SH: Tensor, inverse: bool, dtype: torch.dtype) -> Tensor:
    """-> [B, N, S, H] contiguous in `dtype`: optimus.kernels.rope.Rotate."""
    if x_BNSH.stride(-1) != 1:  # the kernel walks the head dimension in place
        x_BNSH = x_BNSH.contiguous()
    return tk.rope(x_BNSH, cos_SH.contiguous(), sin_SH.contiguous(), inverse, dtype)


@_rope.register_fake
def _(x_BNSH, cos_SH, sin_SH, inverse, dtype):
    return x_BNSH.new_empty(x_BNSH.shape, dtype=dtype)


def rope_rotate(x_BNSH: Tensor, cos_SH: Tensor, sin_SH: Tensor, inverse: bool, dtype: torch.dtype) -> Tensor:
    """optimus.kernels.rope.Rotate in one Triton kernel."""
    return _rope(x_BNSH, cos_SH, sin_SH, inverse, dtype)


# ---- the backend's interface ----


def permute(x_TD: Tensor, token_idx_A: Tensor) -> Tensor:
    """x_AD[a] = x_TD[token_idx_A[a]]."""
    return _permute(x_TD, token_idx_A, compute_dtype(x_TD))


def expert_swiglu_mlp(x_AD: Tensor, w13_EDF2: Tensor, w2_EFD: Tensor, offsets_E: Tensor) -> Tensor:
    """Per-expert SwiGLU MLP over expert-sorted rows (see reference.expert_swiglu_mlp)."""
    _check_rows(offsets_E, x_AD.shape[0])
    return _swiglu_mlp(x_AD, w13_EDF2, w2_EFD, offsets_E.to(torch.int32), compute_dtype(x_AD))[0]


def combine(y_AD: Tensor, token_idx_A: Tensor, weight_A: Tensor, n_tokens: int) -> Tensor:
    """out[t] = sum over assignments a of token t of weight_A[a] * y_AD[a]."""
    return _combine(y_AD, token_idx_A, weight_A, n_tokens, compute_dtype(y_AD))


def grouped_mm(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """Differentiable grouped GEMM: y[rows of e] = x[rows of e] @ w[e]."""
    _check_rows(offsets_E, x_AK.shape[0])
    return _grouped_mm(x_AK, w_EKN, offsets_E.to(torch.int32), compute_dtype(x_AK))


def smoke_test() -> bool:
    """Compile and run one small grouped GEMM on the GPU; True when it matches torch."""
    device = "cuda" if torch.cuda.is_available() else "xpu"
    x = torch.randn(40, 32, device=device, dtype=torch.float16)
    w = torch.randn(2, 32, 48, device=device, dtype=torch.float16)
    offsets = torch.tensor([24, 40], device=device, dtype=torch.int32)
    y = tk.grouped_gemm(x, w, offsets)
    expect = torch.cat([x[:24] @ w[0], x[24:] @ w[1]])
    return bool(torch.allclose(y.float(), expect.float(), atol=1e-1, rtol=1e-2))


# ---- FLOPs of the operators that multiply matrices (torch's FLOP counter and the performance model's pricing,
# optimus.perf.step_trace.op_cost, read them from torch.utils.flop_counter's registry) ----


@register_flop_formula(torch.ops.optimus.triton_swiglu_mlp)
def _swiglu_mlp_flops(x_shape, w13_shape, w2_shape, offsets_shape, dtype, out_shape=None) -> int:
    rows, dim = x_shape
    ffn = w2_shape[1]
    return 2 * rows * dim * 2 * ffn + 2 * rows * ffn * dim  # x @ w13[e], then h @ w2[e]


@register_flop_formula(torch.ops.optimus.triton_swiglu_backward)
def _swiglu_backward_flops(dy_shape, w2_shape, h13_shape, offsets_shape, out_shape=None) -> int:
    return 2 * dy_shape[0] * w2_shape[1] * w2_shape[2]  # dh = dy @ w2[e]^T


@register_flop_formula(torch.ops.optimus.triton_grouped_mm)
def _grouped_mm_flops(x_shape, w_shape, offsets_shape, dtype, out_shape=None) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[2]


@register_flop_formula([torch.ops.optimus.triton_grouped_wgrad, torch.ops.optimus.triton_grouped_wgrad_into])
def _grouped_wgrad_flops(
    x_shape, g_shape, offsets_shape, out, x2_shape=None, g2_shape=None, offsets2_shape=None, out_shape=None
) -> int:
    rows = x_shape[0] + (x2_shape[0] if x2_shape is not None else 0)  # both parts' rows meet the same weights
    return 2 * rows * x_shape[1] * g_shape[1]
