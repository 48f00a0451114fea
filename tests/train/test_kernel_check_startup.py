"""The start-up check of the kernels (optimus/train/kernel_check.py): a kernel made wrong on purpose (the last
row of each 16-row tile dropped, the weight read transposed, a norm's output scaled) stops the run before step 1
with one sentence naming it, on every rank; a correct backend passes; a dense model's check is its norms' and its
RoPE's; the
default runs it on every device but a CPU."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import torch.distributed as dist

import optimus.kernels as kernels
from optimus.config import OptimusConfig
from optimus.kernels import reference, torch_backend
from optimus.kernels.rms_norm import TORCH_NORM
from optimus.kernels.rope import torch_rotate
from optimus.parallel import build_parallel_state
from optimus.parallel.state import ParallelState
from optimus.recipes import load_config
from optimus.train.kernel_check import KernelCheckFailed, check_kernels, kernel_check_enabled, startup_case
from tests.conftest import SMALL_MODEL_RUN
from tests.distributed import run_distributed

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
CPU = torch.device("cpu")

# What every failure of the torch backend's kernels on the small run's shape (96 tokens, dim 32, ffn 32,
# 4 experts, top-2, expert 2 empty) says, but the kernel and the error.
TORCH_FAILURE = re.compile(
    r"At start-up, the torch kernel (?P<kernel>.+) in float32 at 96 tokens: 192 rows x 32 -> 32, 4 experts, "
    r"experts \[2\] empty is off by (?P<error>\S+) relative to the reference \(tolerance 1\.0e-05\); use "
    r"kernels=triton where Triton runs, or another torch build, or set check_kernels=false to train anyway\."
)


def drops_last_row_of_each_tile(grouped_mm):
    """`grouped_mm` (any signature whose first argument is x [A, K]) with rows 15, 31, ... of its output zeroed:
    a tile loop that stops one row short."""

    def wrong(*args):
        y_AN = grouped_mm(*args).clone()
        y_AN[15::16] = 0
        return y_AN

    return wrong


def reads_weight_transposed(grouped_mm):
    """`grouped_mm(x_AK, w_EKN, ...)` reading each expert's [K, N] weight with the strides of its transpose (the
    transpose itself when K = N), as a kernel given the wrong layout does."""

    def wrong(x_AK, w_EKN, *rest):
        n_experts, k, n = w_EKN.shape
        return grouped_mm(x_AK, w_EKN.contiguous().view(n_experts, n, k).transpose(1, 2), *rest)

    return wrong


def small_config(n_experts: int = 4, top_k: int = 2, dim: int = 32, ffn: int = 32, kernels: str = "torch"):
    cfg = OptimusConfig(kernels=kernels, check_kernels=True)
    cfg.model.dim, cfg.model.moe.expert_dim = dim, ffn
    cfg.model.moe.n_experts, cfg.model.moe.top_k = n_experts, top_k
    return cfg


def raised(cfg: OptimusConfig, dtype=torch.float32, device=CPU, ps: ParallelState | None = None) -> str | None:
    """The sentence the check raises on one process, or None when it passes."""
    try:
        check_kernels(cfg, ParallelState() if ps is None else ps, device, dtype)
    except KernelCheckFailed as err:
        return str(err)
    return None


@pytest.mark.parametrize("wrong", [drops_last_row_of_each_tile, reads_weight_transposed])
def test_a_wrong_torch_kernel_stops_the_trainer_before_step_1(wrong, monkeypatch, tmp_path):
    monkeypatch.setattr(torch_backend, "grouped_mm", wrong(torch_backend.grouped_mm))
    run_dir = tmp_path / "run"
    cfg = load_config([*SMALL_MODEL_RUN, "check_kernels=true", f"run.dir={run_dir}"])
    from optimus.train.trainer import Trainer

    with pytest.raises(KernelCheckFailed) as err:
        Trainer.from_config(cfg)
    sentence = TORCH_FAILURE.fullmatch(str(err.value))
    assert sentence, str(err.value)
    # The SwiGLU MLP's forward is the first kernel run on the grouped GEMM; a dropped row of 16 moves it by about
    # 1/4 in norm, a transposed weight by about sqrt(2).
    assert sentence["kernel"] == "expert_swiglu_mlp forward"
    assert float(sentence["error"]) > 0.1
    assert not run_dir.exists()  # stopped before anything was written


def test_every_kernel_on_the_grouped_gemm_is_caught(monkeypatch):
    """The SwiGLU MLP's forward is not the only kernel the wrong GEMM feeds: with it repaired, the plain
    grouped GEMM's forward is the next named."""
    monkeypatch.setattr(torch_backend, "grouped_mm", drops_last_row_of_each_tile(torch_backend.grouped_mm))
    monkeypatch.setattr(torch_backend, "expert_swiglu_mlp", reference.expert_swiglu_mlp)
    sentence = TORCH_FAILURE.fullmatch(raised(small_config()) or "")
    assert sentence and sentence["kernel"] == "grouped_mm forward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_torch_backend_passes_and_leaves_the_random_state_alone(dtype):
    rng_before = torch.get_rng_state()
    assert raised(small_config(n_experts=8, top_k=3, dim=48, ffn=40), dtype) is None
    assert torch.equal(torch.get_rng_state(), rng_before)  # the model's initialisation draws the same values


def test_the_case_is_the_models_widths_over_this_ranks_experts():
    cfg = small_config(n_experts=16, top_k=4, dim=48, ffn=40)
    case = startup_case(cfg.model, ep=2)
    assert (case.dim, case.ffn, case.experts, case.top_k, case.empty_experts) == (48, 40, 8, 4, (4,))
    # Fewer local experts than top_k: a token has at most one row on each, and none is left empty.
    assert (startup_case(cfg.model, ep=8).top_k, startup_case(cfg.model, ep=8).empty_experts) == (2, ())


def test_a_dense_model_checks_its_norms_and_rope_alone(monkeypatch):
    cfg = small_config(dim=48)
    cfg.model.moe.n_experts = 0
    assert (startup_case(cfg.model, ep=1).tokens, startup_case(cfg.model, ep=1).dim) == (96, 48)
    # a wrong expert kernel, which a dense model never calls, does not stop it
    monkeypatch.setattr(torch_backend, "grouped_mm", drops_last_row_of_each_tile(torch_backend.grouped_mm))
    assert raised(cfg) is None

    def scaled_forward(*args):
        y_ND, rstd_N = TORCH_NORM.forward(*args)
        return y_ND * 1.01, rstd_N

    monkeypatch.setattr(kernels, "TORCH_NORM", dataclasses.replace(TORCH_NORM, forward=scaled_forward))
    assert raised(cfg) == (
        "At start-up, the torch kernel rms_norm forward in float32 at 96 tokens: 96 rows x 48 is off by 1.00e-02 "
        "relative to the reference (tolerance 1.0e-05); use kernels=triton where Triton runs, or another torch "
        "build, or set check_kernels=false to train anyway."
    )
    monkeypatch.setattr(kernels, "TORCH_NORM", TORCH_NORM)
    monkeypatch.setattr(
        kernels, "torch_rotate", lambda x, cos, sin, inverse, dtype: torch_rotate(x, cos, -sin, inverse, dtype)
    )
    assert raised(cfg).startswith("At start-up, the torch kernel rope forward in float32 at 96 tokens: 96 rows x 48 is")


def test_null_means_on_for_every_device_but_a_cpu():
    assert [kernel_check_enabled(None, d) for d in ("cpu", "cuda", "xpu")] == [False, True, True]
    assert [kernel_check_enabled(True, d) for d in ("cpu", "cuda")] == [True, True]
    assert [kernel_check_enabled(False, d) for d in ("cpu", "cuda")] == [False, False]
    assert OptimusConfig().check_kernels is None
    assert load_config(["check_kernels=false"]).check_kernels is False


def _check_on_ranks(ep: int, broken_rank: int | None) -> str | None:
    """The sentence this rank raises; `broken_rank` gets a grouped GEMM that drops the last row of each tile."""
    if dist.get_rank() == broken_rank:
        torch_backend.grouped_mm = drops_last_row_of_each_tile(torch_backend.grouped_mm)
    ps = build_parallel_state(ep, 60.0, 1, 1, "cpu", True)
    return raised(small_config(n_experts=4, top_k=2), ps=ps)


def test_a_kernel_wrong_on_one_rank_stops_every_rank_with_one_sentence(single_threaded):
    sentences = run_distributed(_check_on_ranks, 2, 2, 1)
    # ep=2: each rank checks its own 2 of the 4 experts; rank 0's kernels are right, rank 1's error is reported.
    assert sentences[0] == sentences[1]
    assert sentences[0].startswith(
        "At start-up, the torch kernel expert_swiglu_mlp forward in float32 at 96 tokens: 192 rows x 32 -> 32, "
        "2 experts is off by "
    )
    assert run_distributed(_check_on_ranks, 2, 2, None) == [None, None]


@pytest.fixture
def triton_kernels():
    """optimus.kernels.triton_kernels, on the GPU or under the interpreter (tests/conftest.py chose it)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton); the triton backend is optional")
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1: tests/conftest.py sets it before triton is imported")
    from optimus.kernels import triton_kernels

    return triton_kernels


# The interpreter runs one Python step per program: widths of a few 16-wide tiles, neither a multiple of 16, and
# fp32 only (it computes tl.dot on bf16 inputs wrongly).
TRITON_WIDTHS = {"n_experts": 4, "top_k": 2, "dim": 24, "ffn": 40, "kernels": "triton"}


@pytest.mark.parametrize("wrong", [None, reads_weight_transposed], ids=["correct", "weight transposed"])
def test_the_triton_backend_is_checked_under_the_interpreter(wrong, triton_kernels, monkeypatch):
    if wrong is not None:
        monkeypatch.setattr(triton_kernels, "grouped_gemm", wrong(triton_kernels.grouped_gemm))
    # A choice autotuning made, as on a GPU (the interpreter has one configuration, and tunes nothing)
    tuned = [triton_kernels._grouped_gemm_kernel, triton_kernels._swiglu_fwd_kernel]
    for kernel in tuned:
        monkeypatch.setitem(kernel.cache, ("a width", "another"), kernel.configs[0])
    sentence = raised(small_config(**TRITON_WIDTHS), device=torch.device("cuda" if ON_GPU else "cpu"))
    if wrong is None:
        assert sentence is None
        # What the check's 192 rows would tune fixes the tiles of every later call: forgotten
        assert all(kernel.cache == {} for kernel in tuned)
    else:
        assert sentence.startswith(
            "At start-up, the triton kernel expert_swiglu_mlp forward in float32 at 96 tokens: 192 rows x 24 -> 40, "
            "4 experts, experts [2] empty is off by "
        ), sentence
        assert sentence.endswith("; use kernels=torch, or set check_kernels=false to train anyway.")
