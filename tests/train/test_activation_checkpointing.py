"""Activation checkpointing changes memory only: the same fp32 trajectory, fewer bytes kept for the backward.

The kept bytes are measured by the profiler (net CPU allocations of a forward and its
loss, i.e. what is alive when the backward starts) and compared with the planner's
count of them (optimus.plan.activation_bytes), mode by mode.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from optimus.cli import load_config
from optimus.config import ConfigError, ModelConfig, MoEConfig
from optimus.config_checks import validate
from optimus.plan import activation_bytes
from tests.builds import rank_model
from tests.conftest import TINY_MODEL
from tests.distributed import run_distributed

MODES = ("none", "selective", "full")


def _measured_bytes(cfg: ModelConfig, mode: str, batch: int, seq_len: int) -> tuple[int, int]:
    """(bytes alive when the backward starts, peak bytes alive during forward and backward) of one
    micro-batch, net of the parameters and of gradients that already exist, from the profiler."""
    model = rank_model(cfg, seed=0, activation_checkpointing=mode)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def forward_backward() -> None:
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()  # the head's fused cross-entropy, as the trainer runs it
        with record_function("backward"):
            loss.backward()

    forward_backward()  # allocates the parameters' gradients
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        forward_backward()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)  # allocations and frees, in order
    backward_start = next(e.time_range.start for e in events if e.name == "backward")
    alive = peak = kept = 0
    for event in events:
        if event.time_range.start < backward_start:
            kept += event.self_cpu_memory_usage
        alive += event.self_cpu_memory_usage
        peak = max(peak, alive)
    return kept, peak


def test_planner_counts_the_activations_each_mode_keeps():
    cfg = ModelConfig(
        n_layers=3, dim=128, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=256, first_k_dense=1,
        moe=MoEConfig(n_experts=8, top_k=2, expert_dim=96, n_shared_experts=1),
    )  # fmt: skip
    batch, seq_len = 4, 64
    measured = {mode: _measured_bytes(cfg, mode, batch, seq_len) for mode in MODES}
    kept = {mode: measured[mode][0] for mode in MODES}
    assert kept["none"] > kept["selective"] > kept["full"], kept
    for mode in MODES:
        planned_kept = activation_bytes(cfg, batch, seq_len, 4, mode, recompute=False)
        assert planned_kept == pytest.approx(kept[mode], rel=0.05), mode
        assert activation_bytes(cfg, batch, seq_len, 4, mode) == pytest.approx(measured[mode][1], rel=0.05), mode


def test_unknown_mode_is_a_config_error():
    cfg = load_config([*TINY_MODEL, "train.activation_checkpointing=some"])
    with pytest.raises(ConfigError, match="train.activation_checkpointing='some' is not supported"):
        validate(cfg)


RUN = [
    *TINY_MODEL,
    "model.dim=32",
    "model.moe.expert_dim=32",
    "model.moe.n_shared_experts=1",
    "model.first_k_dense=1",  # one dense block (recomputed whole under full) and one MoE block
    "train.dtype=fp32",
    "kernels=torch",
    "logging.progress=false",
    "train.steps=3",
    "train.seq_len=16",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.eval_sequences=4",
    "train.eval_interval=3",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
    "parallel.timeout_s=60",
]


def train_modes(overrides: list[str], root: str, cache: str) -> dict[str, list[dict]] | None:
    """Train once per mode on this rank (all ranks in the same order); rank 0 returns each run's metrics."""
    os.environ["OPTIMUS_CACHE"] = cache
    torch.set_num_threads(1)
    from optimus.train.trainer import Trainer

    runs = {}
    for mode in MODES:
        run_dir = os.path.join(root, mode)
        trainer = Trainer.from_config(
            load_config([*overrides, f"run.dir={run_dir}", f"train.activation_checkpointing={mode}"])
        )
        trainer.fit()
        if trainer.ps.rank == 0:
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                runs[mode] = [json.loads(line) for line in f]
            with open(os.path.join(run_dir, "run_info.json")) as f:
                runs[mode].append(json.load(f))
    return runs or None


def assert_same_trajectory(runs: dict[str, list[dict]]) -> None:
    *reference, info = runs["none"]
    assert [m["step"] for m in reference] == [0, 1, 2, 3]
    for mode in ("selective", "full"):  # the held-out loss before training
        assert runs[mode][0]["val_loss"] == pytest.approx(reference[0]["val_loss"], rel=1e-6), mode
    reference = reference[1:]
    for mode in ("selective", "full"):
        _, *metrics, _ = runs[mode]
        for m, ref in zip(metrics, reference, strict=True):
            for key in ("loss", "lm_loss", "aux_loss", "grad_norm", "expert_load_imbalance"):
                assert m[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-12), f"{mode}: step {m['step']} {key}"
        assert metrics[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], rel=1e-6), mode
    # Each run records its measured peak per rank (run_info.json) and at evaluations (metrics.jsonl).
    assert all(rank["peak_memory_bytes"] > 0 for rank in info["per_rank"])
    assert info["peak_memory_bytes"] == max(rank["peak_memory_bytes"] for rank in info["per_rank"])
    assert reference[-1]["peak_memory_bytes"] >= info["peak_memory_bytes"] > 0


def test_single_process_trajectory_is_unchanged(tmp_path, corpus_file):
    cache = os.environ["OPTIMUS_CACHE"]
    threads = torch.get_num_threads()
    try:
        runs = train_modes([*RUN, "data=text", f"data.path={corpus_file}"], str(tmp_path), cache)
    finally:
        torch.set_num_threads(threads)
    assert_same_trajectory(runs)


def test_expert_parallel_trajectory_is_unchanged(tmp_path, corpus_file):
    """EP 2 on 2 processes: the exchange stays outside every recomputed region, so ranks stay in step."""
    cache = os.environ["OPTIMUS_CACHE"]
    overrides = [*RUN, "data=text", f"data.path={corpus_file}", "parallel.ep=2"]
    results = run_distributed(train_modes, 2, overrides, str(tmp_path), cache, timeout_s=300)
    assert results[1] is None
    assert_same_trajectory(results[0])


def _step_flops(cfg: ModelConfig, mode: str, batch: int, seq_len: int) -> int:
    """Matrix-product and attention FLOPs of one forward and backward, counted by torch's FLOP counter (the CPU's
    attention and grouped GEMM priced by shape here: the counter has no formula for them), with torch's early
    stop off so that a checkpointed module's whole forward runs again, as Megatron's convention counts it."""
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    aten = torch.ops.aten
    by_shape = {
        aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(q, k, v),
        aten._grouped_mm: lambda a, b, *_, **__: 2 * a[0] * a[-1] * b[-1],  # [rows, K] x [experts, K, N]
    }
    model = rank_model(cfg, seed=0, activation_checkpointing=mode)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    with set_checkpoint_early_stop(False), FlopCounterMode(display=False, custom_mapping=by_shape) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return counter.get_total_flops()


def test_recompute_flops_are_the_recomputed_modules_whole_forward():
    """recompute_flops_per_token (the HFU's extra FLOPs) against the FLOPs a checkpointed step runs beyond an
    uncheckpointed one with torch's early stop off (Megatron-DeepSpeed's count: every recomputed module's whole
    forward): a dense block, MoE blocks with routed and shared experts, attention in each."""
    from optimus.parallel.activation_checkpointing import recompute_flops_per_token

    cfg = ModelConfig(
        n_layers=3, dim=128, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=256, first_k_dense=1, qk_norm="none",
        moe=MoEConfig(n_experts=8, top_k=2, expert_dim=96, n_shared_experts=1),
    )  # fmt: skip
    batch, seq_len = 2, 64
    flops = {mode: _step_flops(cfg, mode, batch, seq_len) for mode in MODES}
    for mode in MODES:
        extra = flops[mode] - flops["none"]
        # The formula counts the norms' weights as the model's FLOPs do (6 N): 2 x 2 D per token in the dense
        # block under `full`, which the counter does not see (they multiply elementwise).
        assert recompute_flops_per_token(cfg, mode, seq_len) * batch * seq_len == pytest.approx(extra, rel=1e-3), mode
    assert flops["full"] > flops["selective"] > flops["none"]
