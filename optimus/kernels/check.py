"""Each expert-path, RMSNorm and RoPE kernel of a backend, forward and backward, against the plain-PyTorch reference.

A kernel that is wrong on one device does not crash: it trains on wrong numbers. This module runs every
differentiable operation of a backend (`permute`, `expert_swiglu_mlp`, `combine`, `grouped_mm`, `rms_norm`, `rope`) and
the counting kernel on given shapes and dtypes, computes the same outputs and gradients with
`optimus.kernels.reference` in fp32 on the same (rounded) inputs, and reports for each kernel the relative
error ||got - ref|| / ||ref|| (a NaN, an Inf or a wrong shape counts as an infinite error) against the
dtype's tolerance. `optimus selftest` runs it at a recipe's shapes and at awkward ones; the trainer's start-up
check (optimus/train/kernel_check.py) runs it once on a small case before step 1.

Kernels are named by the operation and the output they produce, which is how a failure is located: forward
outputs (`grouped_mm forward`), input gradients (`grouped_mm dgrad`), weight gradients (`grouped_mm wgrad`).

Tolerances follow from the compute dtype's unit roundoff u (2^-8 for bf16, 2^-11 for fp16 and for TF32,
2^-24 for fp32): a kernel rounds its operands and its output to the compute dtype, and a SwiGLU MLP rounds
its hidden activations once more, so a correct kernel lands within a few u of the fp32 reference in norm.
The tolerance is 5u, except fp32, which is 1e-5 where matrix products run in IEEE fp32 (the error of a sum of
K products grows like sqrt(K) u: 1e-5 holds to K of about 10^5) and 5 x 2^-11 on GPUs, where Triton's
`tl.dot` and cuBLAS may run fp32 operands as TF32. A kernel made wrong (one row of a tile dropped, a weight
transposed) is off by far more: a dropped row of a 128-row tile moves the output by about 1/sqrt(128) = 0.09.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from optimus.kernels import KernelBackend, reference
from optimus.kernels.counting import count_ids
from optimus.kernels.rms_norm import rms_norm
from optimus.kernels.rope import apply_rope

NORM_EPS = 1e-6  # the checked RMSNorm's (the models' norm_eps is of this order)
ROPE_HEAD_DIM = 64  # the checked RoPE's heads, where the width holds whole ones (else one head of the even width)
# The operations a model without MoE layers runs of a backend (check_backend's `dense_only`).
DENSE_OPERATIONS = ("rms_norm", "rope")

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
TF32_UNIT_ROUNDOFF = 2.0**-11
FP32_IEEE_TOLERANCE = 1e-5


def tolerance(dtype: torch.dtype, device_type: str) -> float:
    """The largest relative error (in norm) a correct kernel computing in `dtype` on `device_type` shows."""
    if dtype == torch.float32:
        return FP32_IEEE_TOLERANCE if device_type == "cpu" else 5 * TF32_UNIT_ROUNDOFF
    return 5 * UNIT_ROUNDOFF[dtype]


@dataclass(frozen=True)
class Case:
    """One expert-path shape: `tokens` tokens of width `dim`, each routed to `top_k` of `experts` experts of hidden
    width `ffn`; `empty_experts` get no rows; `one_expert` sends every row to expert 0 (the most rows one expert's
    tile walk sees)."""

    name: str
    tokens: int
    dim: int
    ffn: int
    experts: int
    top_k: int
    empty_experts: tuple[int, ...] = ()
    one_expert: bool = False

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    def describe(self) -> str:
        empty = f", experts {list(self.empty_experts)} empty" if self.empty_experts else ""
        one = ", every row to expert 0" if self.one_expert else ""
        return f"{self.name}: {self.rows} rows x {self.dim} -> {self.ffn}, {self.experts} experts{empty}{one}"


def recipe_cases(dim: int, ffn: int, experts: int, top_k: int, tokens: int, ragged_widths: bool = False) -> list[Case]:
    """The recipe's own shape (`tokens` tokens per micro-batch, `experts` experts on this rank) and the awkward
    ones: one row, empty experts, row counts that fill no tile (67 tokens), and the recipe's rows all on one
    expert; with `ragged_widths`, the 67 tokens' widths one past a multiple of 16 as well. A recipe's widths stay
    what they are in every step, so a node is checked at its own (on a GPU each new width also costs Triton a
    compile and an autotuning of every kernel); the tests check the kernels' width masks."""
    k = min(top_k, experts)
    cases = [Case("recipe", tokens, dim, ffn, experts, k)]
    cases.append(Case("one row", 1, dim, ffn, experts, 1))
    if experts > k:
        empty = tuple(range(1, experts, 2))[: experts - k]
        cases.append(Case("empty experts", max(tokens // 8, 3), dim, ffn, experts, k, empty_experts=empty))
    widths = (_past_tile(dim), _past_tile(ffn)) if ragged_widths else (dim, ffn)
    cases.append(Case("ragged tiles", 67, *widths, max(experts, 2), min(k, 2)))
    cases.append(Case("rows on one expert", tokens, dim, ffn, experts, 1, one_expert=True))
    return cases


def _past_tile(n: int) -> int:
    """n rounded up to a multiple of 16, plus 1: no tile size divides it."""
    return 16 * math.ceil(n / 16) + 1


def routing(case: Case, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_idx_A int64, weight_A fp32, offsets_E int32) for `case`, on the CPU, in expert-sorted order."""
    if case.one_expert:
        token_idx_A = torch.arange(case.tokens).repeat_interleave(case.top_k)
        weight_A = torch.rand(case.rows, generator=generator) * 0.9 + 0.05
        offsets_E = torch.full((case.experts,), case.rows, dtype=torch.int32)
        return token_idx_A, weight_A, offsets_E
    return reference.random_routing(case.tokens, case.experts, case.top_k, generator, case.empty_experts)


@dataclass(frozen=True)
class KernelResult:
    kernel: str  # the operation and the output checked, e.g. "grouped_mm wgrad"
    dtype: torch.dtype
    case: Case
    error: float  # ||got - ref|| / ||ref||; inf for a NaN, an Inf, a wrong shape or an exception
    tolerance: float
    raised: str | None = None  # the exception the kernel raised instead of computing, as "Type: first line"

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def failure(self, backend: str) -> str:
        """One sentence: which kernel, dtype and shape, how far off, and what to set instead."""
        shape = self.case.describe()
        if self.kernel.startswith(DENSE_OPERATIONS):  # the norm and RoPE see the tokens' rows, not the experts'
            shape = f"{self.case.name}: {self.case.tokens} rows x {self.case.dim}"
        where = f"the {backend} kernel {self.kernel} in {self.dtype_name} at {shape}"
        fallback = "kernels=torch" if backend != "torch" else "kernels=triton where Triton runs, or another torch build"
        if self.raised is not None:
            return f"{where} raised {self.raised.rstrip('.')}; use {fallback}."
        off = "returned NaN, Inf or a wrong shape" if math.isinf(self.error) else f"is off by {self.error:.2e}"
        return f"{where} {off} relative to the reference (tolerance {self.tolerance:.1e}); use {fallback}."


def relative_error(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, inf for a missing result, a wrong shape or a non-finite value. In fp64 on a CPU;
    on an accelerator in fp32 where `got` is, with one value read back (an fp64 or host copy of a weight-stack
    gradient would cost gigabytes and seconds; fp32's norms are exact to far below any tolerance). `want` may be
    on the host (a reference computed there): it is moved to `got`'s device."""
    if got is None or got.shape != want.shape:
        return math.inf
    wide = torch.float64 if got.device.type == "cpu" else torch.float32
    got_w, want_w = got.detach().to(wide), want.detach().to(got.device, wide)
    finite, diff, scale = torch.stack(
        [torch.isfinite(got_w).all().to(wide), (got_w - want_w).norm(), want_w.norm()]
    ).tolist()
    if not finite:
        return math.inf
    return diff / scale if scale > 0 else diff


def _leaves(case: Case, dtype: torch.dtype, device: torch.device, generator: torch.Generator):
    """x [T, D], W13 [E, D, 2F], W2 [E, F, D], the routing weights [A] and a norm's weight [D] in `dtype`, and the
    routing, on `device`."""
    x_TD = torch.randn(case.tokens, case.dim, generator=generator)
    w13_EDF2 = torch.randn(case.experts, case.dim, 2 * case.ffn, generator=generator) / case.dim**0.5
    w2_EFD = torch.randn(case.experts, case.ffn, case.dim, generator=generator) / case.ffn**0.5
    token_idx_A, weight_A, offsets_E = routing(case, generator)
    norm_w_D = torch.rand(case.dim, generator=generator) + 0.5
    leaves = [t.to(device, dtype) for t in (x_TD, w13_EDF2, w2_EFD, weight_A, norm_w_D)]
    return leaves, token_idx_A.to(device), offsets_E.to(device)


def _outputs_and_grads(fn, inputs: list[torch.Tensor], dout: torch.Tensor):
    """fn(*inputs) and the gradients of <fn(*inputs), dout> with respect to each input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True)]


def _heads(x_TD: torch.Tensor) -> torch.Tensor:
    """x's rows as attention's q sees them: [1, heads, T, head_dim], strided (heads of ROPE_HEAD_DIM where the
    width holds whole ones, else one head of the width's even part)."""
    width = x_TD.shape[1] - x_TD.shape[1] % 2
    head_dim = ROPE_HEAD_DIM if width % ROPE_HEAD_DIM == 0 else width
    return x_TD[:, :width].unflatten(1, (width // head_dim, head_dim)).transpose(0, 1).unsqueeze(0)


def rope_tables(x_TD: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim / 2] (fp32, on x's device) of random angles, for RoPE over _heads(x)."""
    angles = torch.rand(x_TD.shape[0], _heads(x_TD).shape[-1] // 2, generator=generator) * 6.3
    return angles.cos().to(x_TD.device), angles.sin().to(x_TD.device)


def _operations(backend_or_reference, token_idx_A, offsets_E, n_tokens: int, cos_SH, sin_SH) -> dict:
    """Each differentiable operation as (function of its float inputs, names of its outputs and gradients)."""
    ops = backend_or_reference
    if isinstance(ops, KernelBackend):
        norm = lambda x, w: rms_norm(x, w, NORM_EPS, ops.rms_norm)  # noqa: E731
        rope = lambda x: apply_rope(_heads(x), cos_SH, sin_SH, rotate=ops.rope)  # noqa: E731
    else:
        norm = lambda x, w: ops.rms_norm(x, w, NORM_EPS)  # noqa: E731
        rope = lambda x: ops.rope(_heads(x), cos_SH, sin_SH)  # noqa: E731
    return {
        "permute": (lambda x: ops.permute(x, token_idx_A), ("forward", "backward")),
        "expert_swiglu_mlp": (
            lambda x, w13, w2: ops.expert_swiglu_mlp(x, w13, w2, offsets_E),
            ("forward", "dgrad", "wgrad w13", "wgrad w2"),
        ),
        "combine": (lambda y, w: ops.combine(y, token_idx_A, w, n_tokens), ("forward", "backward dy", "backward dw")),
        "grouped_mm": (lambda x, w: ops.grouped_mm(x, w, offsets_E), ("forward", "dgrad", "wgrad")),
        "rms_norm": (norm, ("forward", "dgrad", "wgrad")),
        "rope": (rope, ("forward", "backward")),
    }


def check_backend(
    backend: KernelBackend,
    cases: list[Case],
    dtypes: list[torch.dtype],
    device: torch.device | str,
    seed: int = 0,
    dense_only: bool = False,
) -> list[KernelResult]:
    """Every kernel of `backend` on every case and dtype, against the fp32 reference on the same rounded inputs
    (`dense_only`: the RMSNorm's and RoPE's alone (DENSE_OPERATIONS), at the case's `dim`: what a dense model
    runs)."""
    device = torch.device(device)
    results = []
    for case in cases:
        for dtype in dtypes:
            results += _check_case(backend, case, dtype, device, torch.Generator().manual_seed(seed), dense_only)
    return results


def _check_case(
    backend, case: Case, dtype: torch.dtype, device: torch.device, gen, dense_only: bool
) -> list[KernelResult]:
    (x_TD, w13, w2, weight_A, norm_w_D), token_idx_A, offsets_E = _leaves(case, dtype, device, gen)
    tol = tolerance(dtype, device.type)
    x_AD = reference.permute(x_TD, token_idx_A)
    y_AD = torch.randn(case.rows, case.dim, generator=gen).to(device, dtype)
    inputs = {
        "permute": [x_TD],
        "expert_swiglu_mlp": [x_AD, w13, w2],
        "combine": [y_AD, weight_A],
        "grouped_mm": [x_AD, w13],
        "rms_norm": [x_TD, norm_w_D],
        "rope": [x_TD],
    }
    cos_SH, sin_SH = rope_tables(x_TD, gen)
    got_ops = _operations(backend, token_idx_A, offsets_E, case.tokens, cos_SH, sin_SH)
    want_ops = _operations(reference, token_idx_A, offsets_E, case.tokens, cos_SH, sin_SH)
    results = []
    for name, (fn, labels) in got_ops.items():
        if dense_only and name not in DENSE_OPERATIONS:
            continue
        with _ieee_fp32():
            want_fn = want_ops[name][0]
            with torch.no_grad():
                dout = torch.randn(want_fn(*[t.float() for t in inputs[name]]).shape, generator=gen).to(device, dtype)
            want = _outputs_and_grads(want_fn, [t.float() for t in inputs[name]], dout.float())
        raised = None
        try:
            got = _outputs_and_grads(fn, inputs[name], dout)
            _synchronize(device)  # a kernel's fault surfaces here, as this kernel's, not at a later read
        except torch.OutOfMemoryError:  # the case does not fit beside what the process holds: not the kernel's fault
            raise
        except Exception as err:  # a kernel that raises on this device is as wrong as one that computes wrongly
            got, raised = [None] * len(labels), f"{type(err).__name__}: {(str(err).strip() or '?').splitlines()[0]}"
        for label, g, w in zip(labels, got, want):
            results.append(KernelResult(f"{name} {label}", dtype, case, relative_error(g, w), tol, raised))
    if dense_only:
        return results
    counts = count_ids(token_idx_A, case.tokens)
    want_counts = torch.bincount(token_idx_A.cpu(), minlength=case.tokens)
    results.append(KernelResult("count_ids", torch.int64, case, relative_error(counts, want_counts), 0.0))
    return results


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


class _ieee_fp32:
    """The reference's fp32 matrix products in IEEE fp32, whatever the process allows (TF32 would make the
    reference itself off by 2^-11)."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def first_failure(results: list[KernelResult]) -> KernelResult | None:
    return next((r for r in results if not r.ok), None)
