"""The torch kernel backend and backend selection, checked against optimus.kernels.reference."""

from types import SimpleNamespace

import pytest
import torch
from torch.nn.functional import silu

import optimus.kernels as kernels
from optimus.config import ConfigError, ModelConfig, MoEConfig
from optimus.kernels import KernelUnavailable, cpu_schedules, get_backend, reference, torch_backend
from optimus.kernels.torch_private import TorchDispatchMode
from optimus.kernels.torch_private import grouped_mm as torch_grouped_mm
from optimus.model import Transformer


def make_problem(T, D, F, E, K, dtype=torch.float32, empty_experts=(), seed=0):
    """Random inputs, weights and routing; every float tensor requires grad."""
    gen = torch.Generator().manual_seed(seed)
    token_idx_A, weight_A, offsets_E = reference.random_routing(T, E, K, gen, empty_experts)
    x_TD = torch.randn(T, D, generator=gen).to(dtype)
    w13_EDF2 = (torch.randn(E, D, 2 * F, generator=gen) / D**0.5).to(dtype)
    w2_EFD = (torch.randn(E, F, D, generator=gen) / F**0.5).to(dtype)
    leaves = [t.requires_grad_() for t in (x_TD, w13_EDF2, w2_EFD, weight_A.to(dtype))]
    return leaves, token_idx_A, offsets_E


def expert_path(ops, leaves, token_idx_A, offsets_E):
    x_TD, w13_EDF2, w2_EFD, weight_A = leaves
    x_AD = ops.permute(x_TD, token_idx_A)
    y_AD = ops.expert_swiglu_mlp(x_AD, w13_EDF2, w2_EFD, offsets_E)
    return ops.combine(y_AD, token_idx_A, weight_A, x_TD.shape[0])


def value_and_grads(ops, leaves, token_idx_A, offsets_E, seed=1):
    out_TD = expert_path(ops, leaves, token_idx_A, offsets_E)
    dout_TD = torch.randn(out_TD.shape, generator=torch.Generator().manual_seed(seed)).to(out_TD.device, out_TD.dtype)
    return [out_TD, *torch.autograd.grad(out_TD, leaves, dout_TD)]


def assert_close_rel(got, want, rtol, name=""):
    err = (got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)
    assert err <= rtol, f"{name}: max error {err:.3g} relative to max |value| exceeds {rtol}"


NAMES = ("out", "d x", "d w13", "d w2", "d weight")


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_expert_path_fp32_matches_reference(top_k, grouped, monkeypatch):
    if grouped and torch_grouped_mm is None:
        pytest.skip(f"torch {torch.__version__} has no grouped_mm: the loop is the path that runs there")
    monkeypatch.setattr(torch_backend, "_HAS_GROUPED_MM", grouped)
    # 37 tokens: ragged per-expert row counts; experts 2 and 5 get no rows.
    leaves, token_idx_A, offsets_E = make_problem(37, 16, 24, 11, top_k, empty_experts=(2, 5))
    got = value_and_grads(get_backend("torch"), leaves, token_idx_A, offsets_E)
    want = value_and_grads(reference, leaves, token_idx_A, offsets_E)
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == w.dtype == torch.float32
        assert_close_rel(g, w, 1e-5, name)


def drop_assignments(token_idx_A, offsets_E, keep_every: int):
    """Keep every `keep_every`-th assignment (as capacity drops do): tokens end up with 0..K rows."""
    keep_A = torch.arange(token_idx_A.shape[0]) % keep_every != 0
    expert_A = torch.repeat_interleave(torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).long())
    counts_E = torch.bincount(expert_A[keep_A], minlength=offsets_E.shape[0])
    return keep_A, torch.cumsum(counts_E, 0).to(torch.int32)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_expert_path_with_dropped_assignments_matches_reference(dtype, rtol):
    leaves, token_idx_A, offsets_E = make_problem(29, 16, 8, 5, 3, dtype=dtype)
    keep_A, offsets_E = drop_assignments(token_idx_A, offsets_E, keep_every=3)
    x_TD, w13_EDF2, w2_EFD, weight_A = leaves
    token_idx_A = token_idx_A[keep_A]
    assert torch.bincount(token_idx_A, minlength=29).min() < 3  # some tokens lost assignments
    gen = torch.Generator().manual_seed(2)
    dout_TD = torch.randn(29, 16, generator=gen, dtype=dtype)
    results = []
    for ops in (get_backend("torch"), reference):
        x_AD = ops.permute(x_TD, token_idx_A)
        y_AD = ops.expert_swiglu_mlp(x_AD, w13_EDF2, w2_EFD, offsets_E)
        out_TD = ops.combine(y_AD, token_idx_A, weight_A[keep_A], 29)
        results.append([out_TD, *torch.autograd.grad(out_TD, leaves, dout_TD)])
    for name, g, w in zip(NAMES, *results):
        assert_close_rel(g, w, rtol, name)


def test_unaligned_shapes_use_the_loop_and_match():
    # D=6, F=5 in fp32: 24- and 40-byte row strides, which _grouped_mm rejects.
    leaves, token_idx_A, offsets_E = make_problem(11, 6, 5, 4, 2, empty_experts=(0,))
    assert not torch_backend._use_grouped(4, leaves[0], leaves[1])
    got = value_and_grads(get_backend("torch"), leaves, token_idx_A, offsets_E)
    want = value_and_grads(reference, leaves, token_idx_A, offsets_E)
    for name, g, w in zip(NAMES, got, want):
        assert_close_rel(g, w, 1e-5, name)


def test_grouped_mm_matches_reference():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(29, 16, generator=gen, requires_grad=True)
    w = torch.randn(4, 16, 8, generator=gen, requires_grad=True)
    offsets = torch.tensor([10, 10, 25, 29], dtype=torch.int32)
    dy = torch.randn(29, 8, generator=gen)
    got = [get_backend("torch").grouped_mm(x, w, offsets), None, None]
    got[1:] = torch.autograd.grad(got[0], (x, w), dy)
    want = [reference.grouped_mm(x, w, offsets), None, None]
    want[1:] = torch.autograd.grad(want[0], (x, w), dy)
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert_close_rel(g, r, 1e-5, name)
    assert got[2][1].abs().max() == 0  # expert 1 has no rows


def test_stride_zero_incoming_grad():
    # .sum().backward() hands the MLP an expanded (stride-0) gradient.
    leaves, token_idx_A, offsets_E = make_problem(8, 16, 8, 4, 2)
    be = get_backend("torch")
    expert_path(be, leaves, token_idx_A, offsets_E).sum().backward()
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    expert_path(reference, leaves, token_idx_A, offsets_E).sum().backward()
    for name, g, t in zip(NAMES[1:], got, leaves):
        assert_close_rel(g, t.grad, 1e-5, name)


def test_bf16_autocast_close_to_fp32_reference():
    leaves, token_idx_A, offsets_E = make_problem(40, 32, 32, 6, 2, empty_experts=(4,))
    want = value_and_grads(reference, leaves, token_idx_A, offsets_E)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = value_and_grads(get_backend("torch"), leaves, token_idx_A, offsets_E)
    assert got[0].dtype == torch.bfloat16
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == (torch.bfloat16 if name == "out" else torch.float32)  # grads in the leaves' dtype
        assert_close_rel(g.float(), w, 3e-2, name)


def test_bf16_inputs_close_to_fp32_reference():
    leaves, token_idx_A, offsets_E = make_problem(40, 32, 32, 10, 8, dtype=torch.bfloat16)
    got = value_and_grads(get_backend("torch"), leaves, token_idx_A, offsets_E)
    leaves32 = [t.detach().float().requires_grad_() for t in leaves]
    want = value_and_grads(reference, leaves32, token_idx_A, offsets_E)
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == torch.bfloat16
        assert_close_rel(g.float(), w, 3e-2, name)


@pytest.mark.parametrize("schedule", ["by_expert", "padded"])
def test_bf16_expert_mlp_runs_per_expert_or_padded_where_the_cpu_computes_in_bf16(schedule, monkeypatch):
    """The public op takes a 16-bit CPU schedule whenever its math is 16-bit on a CPU (forced here, so that a
    CPU without bf16 units runs it too): the padded one where `padded_rows` gives a row count, else the
    per-expert one; either matches the fp32 reference."""
    monkeypatch.setattr(torch_backend, "math_dtype", lambda dtype, device: dtype)
    if schedule == "by_expert":
        monkeypatch.setattr(cpu_schedules, "padded_rows", lambda bounds, n_dim, n_ffn: 0)
    else:  # any load qualifies
        monkeypatch.setattr(cpu_schedules, "PADDED_MAX_ROWS_RATIO", float("inf"))
    calls = []
    for name in (f"swiglu_mlp_forward_{schedule}", f"swiglu_mlp_backward_{schedule}"):
        original = getattr(cpu_schedules, name)
        monkeypatch.setattr(cpu_schedules, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    leaves, token_idx_A, offsets_E = make_problem(40, 32, 32, 10, 8, dtype=torch.bfloat16, empty_experts=(3,))
    got = value_and_grads(get_backend("torch"), leaves, token_idx_A, offsets_E)
    assert calls == [f"swiglu_mlp_forward_{schedule}", f"swiglu_mlp_backward_{schedule}"]
    leaves32 = [t.detach().float().requires_grad_() for t in leaves]
    want = value_and_grads(reference, leaves32, token_idx_A, offsets_E)
    for name, g, w in zip(NAMES, got, want):
        assert_close_rel(g.float(), w, 3e-2, name)


def _half_swiglu_mlp(schedule, x, w13, w2, dy, bounds, needs):
    """(y, grads) of one 16-bit CPU schedule of the SwiGLU MLP, forward then backward."""
    if schedule == "by_expert":
        h13, silu_gate, h, y = cpu_schedules.swiglu_mlp_forward_by_expert(x, w13, w2, bounds)
        saved = (x, w13, w2, h13, silu_gate, h)
        return y, cpu_schedules.swiglu_mlp_backward_by_expert(saved, dy, bounds, needs)
    rows = cpu_schedules.cached_rows(max(hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])))
    x_pad, h13, silu_gate, h, y = cpu_schedules.swiglu_mlp_forward_padded(x, w13, w2, bounds, rows)
    saved = (x_pad, w13, w2, h13, silu_gate, h)
    return y, cpu_schedules.swiglu_mlp_backward_padded(saved, dy, bounds, needs)


@pytest.mark.parametrize("schedule", ["by_expert", "by_expert_fine", "padded"])
@pytest.mark.parametrize("needs", [(True, True, True), (False, True, False), (True, False, True)])
def test_half_swiglu_mlp_schedules_match_a_plain_fp32_loop(schedule, needs, monkeypatch):
    """The 16-bit SwiGLU MLP schedules on a CPU equal plain fp32 autograd over the same bf16 values, per expert.
    Per expert: windows past each expert's rows, the last window reading rows before its own (`_fine`: with
    every GEMM counted as large, 32 row counts per octave). Padded: experts of 0 to 300 rows padded to one count.
    All: an empty expert, some gradients not needed."""
    if schedule == "by_expert_fine":
        monkeypatch.setattr(cpu_schedules, "FINE_ROWS_MIN_MACS", 0)
        schedule = "by_expert"
    gen = torch.Generator().manual_seed(6)
    counts, D, n_ffn = [33, 100, 0, 1, 257, 47, 300, 2], 64, 48
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
    x = torch.randn(sum(counts), D, generator=gen).bfloat16()
    w13 = (torch.randn(len(counts), D, 2 * n_ffn, generator=gen) / 8).bfloat16()
    w2 = (torch.randn(len(counts), n_ffn, D, generator=gen) / 7).bfloat16()
    dy = torch.randn(sum(counts), D, generator=gen).bfloat16()
    y, grads = _half_swiglu_mlp(schedule, x, w13, w2, dy, bounds, needs)

    leaves = [t.float().requires_grad_() for t in (x, w13, w2)]
    ys = []
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        gate_up = leaves[0][lo:hi] @ leaves[1][e]
        ys.append((silu(gate_up[:, :n_ffn]) * gate_up[:, n_ffn:]) @ leaves[2][e])
    want_y = torch.cat(ys)
    want = torch.autograd.grad(want_y, leaves, dy.float())
    assert_close_rel(y.float(), want_y, 1e-2, "y")
    for name, got, w, needed in zip(("dx", "dw13", "dw2"), grads, want, needs):
        assert (got is None) == (not needed), name
        if needed:
            assert_close_rel(got.float(), w, 1e-2, name)
    if needs[1]:
        assert grads[1][2].abs().max() == 0  # expert 2 has no rows


def test_padded_schedule_only_for_small_experts_with_even_loads():
    """`padded_rows`: a cached row count covering the busiest expert where experts are small and loads even;
    0 for large experts, for a load whose padding would exceed the ratio, and for no rows at all."""
    even = [0, 500, 1000, 1490, 2000]  # busiest 510 rows
    assert cpu_schedules.padded_rows(even, 256, 256) == cpu_schedules.cached_rows(510) >= 510
    assert cpu_schedules.padded_rows(even, 1024, 1024) == 0  # 500 x 1024 x 1024 multiply-adds per expert
    uneven = [0, 1200, 1500, 1800, 2000]  # 4 x 1216 padded rows for 2000
    assert cpu_schedules.padded_rows(uneven, 256, 256) == 0
    assert cpu_schedules.padded_rows([0, 0, 0], 256, 256) == 0


@pytest.mark.parametrize("drops", [False, True], ids=["dropless", "dropped"])
def test_bf16_rows_widened_in_blocks_match_a_reference_summed_in_fp32(drops, monkeypatch):
    """Permute's backward and combine widen bf16 rows a few tokens at a time (blocks of 8 rows here, so some
    blocks hold only tokens that lost every assignment): each token's sum equals the same bf16 rows summed in
    fp32 by plain PyTorch, rounded once."""
    monkeypatch.setattr(cpu_schedules, "WIDEN_BLOCK_ROWS", 8)
    leaves, token_idx_A, offsets_E = make_problem(29, 16, 8, 5, 3, dtype=torch.bfloat16)
    weight_A = leaves[3]
    if drops:  # tokens 5..14 keep no assignment at all, others keep some
        keep_A = ((token_idx_A < 5) | (token_idx_A >= 15)) & (torch.arange(token_idx_A.shape[0]) % 4 != 0)
        token_idx_A, weight_A = token_idx_A[keep_A], weight_A[keep_A]
    gen = torch.Generator().manual_seed(5)
    y_AD = torch.randn(token_idx_A.shape[0], 16, generator=gen).to(torch.bfloat16).requires_grad_()
    dout_TD = torch.randn(29, 16, generator=gen).to(torch.bfloat16)
    out_TD = torch_backend.combine(y_AD, token_idx_A, weight_A, 29)
    dy_AD, dw_A = torch.autograd.grad(out_TD, (y_AD, weight_A), dout_TD)
    products_AD = y_AD.detach().float() * weight_A.detach().float().unsqueeze(1)
    want_TD = torch.zeros(29, 16).index_add_(0, token_idx_A, products_AD).to(torch.bfloat16)
    assert torch.equal(out_TD, want_TD)
    g_AD = dout_TD.float()[token_idx_A]
    assert torch.equal(dy_AD, (g_AD * weight_A.detach().float().unsqueeze(1)).to(torch.bfloat16))
    assert_close_rel(dw_A.float(), (g_AD * y_AD.detach().float()).sum(1), 1e-2, "d weight")

    x_TD = leaves[0].detach().requires_grad_()
    (dx_TD,) = torch.autograd.grad(torch_backend.permute(x_TD, token_idx_A), x_TD, y_AD.detach())
    want_dx_TD = torch.zeros(29, 16).index_add_(0, token_idx_A, y_AD.detach().float()).to(torch.bfloat16)
    assert torch.equal(dx_TD, want_dx_TD)
    if drops:
        assert dx_TD[5:15].abs().max() == 0


# ---- backend selection ----


def _probes(monkeypatch, gpu, importable, compiles):
    # The triton backend itself is stubbed: importing it here would define compiled (not interpreted) kernels.
    monkeypatch.setattr(kernels, "_triton_backend", lambda: SimpleNamespace(name="triton"))
    monkeypatch.setattr(kernels, "gpu_present", lambda: gpu)
    monkeypatch.setattr(kernels, "triton_importable", lambda: importable)
    monkeypatch.setattr(kernels, "triton_compiles", lambda: compiles)


@pytest.mark.parametrize(
    "gpu, importable, compiles, expect",
    [
        (True, True, True, "triton"),
        (True, True, False, "torch"),  # a GPU where Triton does not compile
        (True, False, False, "torch"),  # Triton not installed
        (False, True, True, "torch"),  # CPU only: Triton could only interpret
    ],
)
def test_auto_selection(monkeypatch, gpu, importable, compiles, expect):
    _probes(monkeypatch, gpu, importable, compiles)
    assert get_backend("auto").name == expect


def test_triton_missing_says_how_to_install(monkeypatch):
    _probes(monkeypatch, True, False, False)
    with pytest.raises(KernelUnavailable, match="pip install triton"):
        get_backend("triton")


def test_triton_without_gpu_says_to_use_torch(monkeypatch):
    _probes(monkeypatch, False, True, False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelUnavailable, match="set kernels=torch"):
        get_backend("triton")


def test_unknown_backend_is_refused():
    with pytest.raises(KernelUnavailable, match="kernels='cuda'"):
        get_backend("cuda")


def test_the_model_reports_an_unavailable_backend_as_a_config_error(monkeypatch):
    # kernels raises its own error (it imports nothing of optimus); the model, where a config's `kernels`
    # key arrives, turns it into the ConfigError that the command line prints as one sentence.
    _probes(monkeypatch, False, True, False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = ModelConfig(n_layers=1, dim=32, n_heads=2, n_kv_heads=1, vocab_size=128, moe=MoEConfig(n_experts=2))
    with pytest.raises(ConfigError, match="set kernels=torch"):
        Transformer(cfg, kernels="triton")


def test_import_does_not_need_triton():
    import subprocess
    import sys

    # Every meta-path finder is wrapped so that it finds no `triton` (find_spec returns None, as for a package
    # that is not installed), since torch's own import-time probes treat an ImportError from find_spec as a bug.
    code = (
        "import importlib.util, sys\n"
        "class HideTriton:  # forwards everything else (invalidate_caches, find_distributions) to the finder\n"
        "    def __init__(self, finder): self.finder = finder\n"
        "    def __getattr__(self, attr): return getattr(self.finder, attr)\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'triton': return None\n"
        "        return self.finder.find_spec(name, path, target)\n"
        "sys.meta_path[:] = [HideTriton(f) for f in sys.meta_path]\n"
        "assert importlib.util.find_spec('triton') is None\n"
        "from optimus.kernels import get_backend\n"
        "assert get_backend('auto').name == 'torch'\n"
        "assert 'triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- 16-bit GEMMs on a CPU: row counts from a small set (oneDNN builds a kernel per shape) ----


def test_cached_rows_round_up_by_at_most_a_sixteenth_from_a_small_set():
    counts = range(1, 8193)
    rounded = [cpu_schedules.cached_rows(n) for n in counts]
    assert all(n <= r <= n * 17 / 16 for n, r in zip(counts, rounded))
    assert all(cpu_schedules.cached_rows(r) == r for r in rounded)  # a fixed point: the set is closed
    assert rounded[:31] == list(range(1, 32))  # exact below 32 rows
    assert len(set(rounded)) == 31 + 16 * 8 + 1  # 16 per octave from 32 to 8191, and 8192


def test_large_gemms_round_rows_by_at_most_a_thirty_second_from_a_set_holding_the_small_one():
    """A GEMM of at least FINE_ROWS_MIN_MACS multiply-adds (coarse experts) rounds to 32 counts per octave; every
    count of the 16-per-octave set is one of them, so a GEMM that crosses the threshold stays on cached counts."""
    per_row = cpu_schedules.FINE_ROWS_MIN_MACS // 512  # the GEMM is large from 512 rows on
    counts = range(1, 8193)
    rounded = [cpu_schedules.cached_rows(n, per_row) for n in counts]
    assert rounded[:511] == [cpu_schedules.cached_rows(n) for n in range(1, 512)]  # small GEMMs: as before
    assert all(n <= r <= n * 33 / 32 for n, r in zip(counts[511:], rounded[511:]))
    assert all(cpu_schedules.cached_rows(r, per_row) == r for r in rounded)
    assert len(set(rounded[511:])) == 32 * 4 + 1  # 32 per octave from 512 to 8191, and 8192
    assert {cpu_schedules.cached_rows(n) for n in range(512, 8193)} <= set(rounded)


class _MatmulShapes(TorchDispatchMode):
    """Records the operand shapes of every mm and addmm (`shapes`) and the reduction length of every addmm_
    (`accumulated`)."""

    def __init__(self):
        super().__init__()
        self.shapes, self.accumulated = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default):
            self.shapes.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
        elif func == torch.ops.aten.addmm_.default:
            self.accumulated.append(args[1].shape[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fine", [False, True], ids=["16-per-octave", "32-per-octave"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gemms_on_cpu_use_cached_row_counts_and_match_the_exact_ones(dtype, fine, monkeypatch):
    """Expert row counts that are not cached sizes (33, 257, 47, 300), the first and last experts too: every
    GEMM runs on cached row counts (windows borrowing neighbouring rows) except the weight gradient's tails,
    which are shorter than a row step and so come from a small set too; the results equal exact per-expert GEMMs
    of the same 16-bit values up to their rounding. `fine`: every GEMM counts as large (32 counts per octave)."""
    if fine:
        monkeypatch.setattr(cpu_schedules, "FINE_ROWS_MIN_MACS", 0)
    per_row = 1 if fine else 0  # what makes cached_rows and row_step below take the same set as the GEMMs
    gen = torch.Generator().manual_seed(4)
    counts = [33, 100, 0, 1, 257, 47, 300, 2]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    bounds = [0, *offsets.tolist()]
    x = torch.randn(sum(counts), 64, generator=gen).to(dtype)
    w = (torch.randn(len(counts), 64, 96, generator=gen) / 8).to(dtype)
    g = torch.randn(sum(counts), 96, generator=gen).to(dtype)
    row_bounds = torch_backend.RowBounds(offsets, sum(counts))
    with _MatmulShapes() as seen:
        y = torch_backend.grouped_mm(x, w, row_bounds)
        dx = torch_backend.grouped_mm(g, w.transpose(1, 2), row_bounds)
        dw = torch_backend.grouped_wgrad(x, g, row_bounds)
    rounded = cpu_schedules.cached_rows
    assert seen.shapes and all(rounded(n, per_row) == n for call in seen.shapes for s in call for n in s)
    step = cpu_schedules.row_step
    tails = sorted(n % step(n, per_row) for n in counts if n and n % step(n, per_row))
    # 33, 47, 257 and 300 rows (32 per octave: 257 and 300 only, 33 and 47 are counts of the set); 100 is one
    assert sorted(seen.accumulated) == tails == ([1, 4] if fine else [1, 1, 1, 12])
    x32, w32, g32 = x.float(), w.float(), g.float()
    exact = [(x32[lo:hi] @ w32[e], g32[lo:hi] @ w32[e].t(), x32[lo:hi].t() @ g32[lo:hi])
             for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]  # fmt: skip
    assert_close_rel(y.float(), torch.cat([e[0] for e in exact]), 1e-2, "y")
    assert_close_rel(dx.float(), torch.cat([e[1] for e in exact]), 1e-2, "dx")
    assert_close_rel(dw.float(), torch.stack([e[2] for e in exact]), 1e-2, "dw")
    assert dw[2].abs().max() == 0  # expert 2 has no rows
