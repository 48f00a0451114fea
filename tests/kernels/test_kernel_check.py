"""optimus.kernels.check: correct backends pass, and a kernel made wrong on purpose is caught and named.

The torch backend runs at a small recipe's shapes in fp32 and bf16; the triton backend under the Triton
interpreter at tiny widths in fp32 (the interpreter computes bf16 dots wrongly).
"""

import dataclasses
import math
import os

import pytest
import torch

from optimus.kernels import get_backend, reference, torch_backend
from optimus.kernels.check import (
    Case,
    check_backend,
    first_failure,
    recipe_cases,
    relative_error,
    routing,
    tolerance,
)
from optimus.kernels.rope import torch_rotate

TINY_CASES = [Case("tiny", 20, 24, 40, 4, 2), Case("empty experts", 9, 17, 33, 5, 1, empty_experts=(1, 3))]


def drop_last_row_of_each_tile(fn, tile=16):
    """fn, with the last row of every `tile` rows of its output zeroed (a tile loop that stops one row short)."""

    def wrong(*args, **kwargs):
        out = fn(*args, **kwargs)
        keep = torch.ones(out.shape[0], 1, dtype=out.dtype, device=out.device)
        keep[tile - 1 :: tile] = 0
        return out * keep

    return wrong


def test_tolerances_follow_the_unit_roundoff():
    assert tolerance(torch.bfloat16, "cuda") == 5 * 2.0**-8
    assert tolerance(torch.float16, "cpu") == 5 * 2.0**-11
    assert tolerance(torch.float32, "cpu") == 1e-5
    assert tolerance(torch.float32, "cuda") == 5 * 2.0**-11  # TF32 operands


def test_relative_error_counts_nan_and_wrong_shapes_as_infinite():
    want = torch.ones(3, 2)
    assert relative_error(want.clone(), want) == 0
    assert math.isclose(relative_error(want * 1.01, want), 0.01, rel_tol=1e-6)
    assert relative_error(torch.full((3, 2), float("nan")), want) == math.inf
    assert relative_error(torch.ones(2, 3), want) == math.inf
    assert relative_error(None, want) == math.inf


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a result on a GPU against a reference on the host")
def test_relative_error_takes_a_reference_made_on_the_host():
    want = torch.arange(6.0).reshape(3, 2)  # (the check's token counts are counted on the host)
    assert relative_error(want.cuda(), want) == 0
    assert math.isclose(relative_error(want.cuda() * 1.01, want), 0.01, rel_tol=1e-5)  # (in fp32 there)


def test_the_awkward_cases_are_awkward():
    cases = {c.name: c for c in recipe_cases(dim=128, ffn=256, experts=8, top_k=2, tokens=512)}
    assert cases["recipe"].rows == 1024 and cases["one row"].rows == 1
    assert cases["ragged tiles"].rows % 16 and (cases["ragged tiles"].dim, cases["ragged tiles"].ffn) == (128, 256)
    ragged = recipe_cases(dim=128, ffn=256, experts=8, top_k=2, tokens=512, ragged_widths=True)[3]
    assert ragged.name == "ragged tiles" and ragged.dim % 16 and ragged.ffn % 16
    empty = cases["empty experts"]
    assert len(empty.empty_experts) == 4 and empty.experts - len(empty.empty_experts) >= empty.top_k
    token_idx_A, _, offsets_E = routing(cases["rows on one expert"], torch.Generator().manual_seed(0))
    assert offsets_E.tolist() == [512] * 8 and token_idx_A.shape == (512,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_torch_backend_passes_at_a_recipes_shapes(dtype):
    results = check_backend(get_backend("torch"), recipe_cases(64, 96, 6, 2, 256), [dtype], "cpu")
    assert first_failure(results) is None, first_failure(results).failure("torch")
    kernels = {r.kernel for r in results}
    assert {"permute backward", "expert_swiglu_mlp wgrad w13", "grouped_mm dgrad", "combine backward dw"} <= kernels
    assert "count_ids" in kernels


def test_a_tile_that_drops_its_last_row_is_named(monkeypatch):
    monkeypatch.setattr(torch_backend, "grouped_mm", drop_last_row_of_each_tile(torch_backend.grouped_mm))
    # fp32: on a CPU 16-bit GEMMs take cpu_schedules' per-expert kernels instead of grouped_mm
    results = check_backend(get_backend("torch"), recipe_cases(32, 48, 4, 2, 64), [torch.float32], "cpu")
    failed = {r.kernel for r in results if not r.ok}
    # The expert MLP's and the grouped GEMM's products go through it; permute and combine do not.
    assert "grouped_mm forward" in failed and "expert_swiglu_mlp forward" in failed
    assert not any(k.startswith(("permute", "combine")) for k in failed)
    sentence = first_failure(results).failure("torch")
    assert sentence.startswith("the torch kernel expert_swiglu_mlp forward in float32 at recipe: 128 rows x 32")
    assert "tolerance 1.0e-05" in sentence and "use kernels=triton" in sentence and sentence.endswith(".")


def test_a_transposed_weight_is_named(monkeypatch):
    real = torch_backend.grouped_wgrad
    monkeypatch.setattr(torch_backend, "grouped_wgrad", lambda *a: real(*a).transpose(1, 2).reshape(real(*a).shape))
    results = check_backend(get_backend("torch"), recipe_cases(32, 48, 4, 2, 64), [torch.float32], "cpu")
    failed = {r.kernel for r in results if not r.ok}
    assert failed == {"expert_swiglu_mlp wgrad w13", "expert_swiglu_mlp wgrad w2", "grouped_mm wgrad"}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="no Triton")
def test_the_triton_backend_passes_and_a_broken_triton_kernel_is_named(monkeypatch):
    pytest.importorskip("triton")
    from optimus.kernels import triton_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = get_backend("triton")
    results = check_backend(backend, TINY_CASES, [torch.float32], device)
    assert first_failure(results) is None, first_failure(results).failure("triton")
    monkeypatch.setattr(triton_kernels, "segment_sum", drop_last_row_of_each_tile(triton_kernels.segment_sum, 4))
    failed = {r.kernel for r in check_backend(backend, TINY_CASES, [torch.float32], device) if not r.ok}
    # segment_sum is permute's backward and combine's forward
    assert {"permute backward", "combine forward"} <= failed
    assert not any(k.startswith(("expert_swiglu_mlp", "grouped_mm")) for k in failed)


def test_a_kernel_that_raises_is_a_failure_not_a_crash(monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel image is available for execution on the device\nmore")

    monkeypatch.setattr(torch_backend, "permute", broken)
    results = check_backend(get_backend("torch"), TINY_CASES[:1], [torch.float32], "cpu")
    failed = [r for r in results if not r.ok]
    assert {r.kernel for r in failed} == {"permute forward", "permute backward"}
    assert (
        failed[0]
        .failure("torch")
        .endswith(
            "raised RuntimeError: no kernel image is available for execution on the device; use kernels=triton where "
            "Triton runs, or another torch build."
        )
    )
    assert reference.permute is not broken


def test_a_rope_that_turns_the_wrong_way_is_named_and_a_dense_model_checks_the_norm_and_rope():
    """RoPE by the opposite angle (a sign lost in a kernel) fails both ways; a dense model's check runs the RMSNorm
    and RoPE alone, RoPE over 64-wide heads where the width holds them (so over a transposed view) and over the
    even part of an odd width."""
    backend = get_backend("torch")
    cases = [Case("heads", 12, 128, 1, 1, 1), TINY_CASES[1]]  # width 128: two heads; 17: one head of 16
    results = check_backend(backend, cases, [torch.float32], "cpu", dense_only=True)
    assert {r.kernel for r in results} == {"rms_norm forward", "rms_norm dgrad", "rms_norm wgrad", "rope forward",
                                           "rope backward"}  # fmt: skip
    assert first_failure(results) is None, first_failure(results).failure("torch")
    backwards = dataclasses.replace(
        backend, rope=lambda x, cos, sin, inverse, dtype: torch_rotate(x, cos, sin, not inverse, dtype)
    )
    failed = [r for r in check_backend(backwards, cases, [torch.float32], "cpu", dense_only=True) if not r.ok]
    assert {r.kernel for r in failed} == {"rope forward", "rope backward"} and len(failed) == 4
    assert failed[0].failure("torch").startswith("the torch kernel rope forward in float32 at heads: 12 rows x 128 is")
