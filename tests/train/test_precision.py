"""train.dtype=bf16: bf16 parameters and activations, fp32 master weights only in the optimizer, no dtype warnings."""

from __future__ import annotations

import json
import warnings

import torch
import torch.nn.functional as F

from optimus.cli import main
from optimus.config import ModelConfig, MoEConfig
from optimus.model import Transformer
from optimus.parallel.parallelize import cast_parameters
from tests.conftest import TINY_MODEL

MODEL = ModelConfig(
    n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=64, first_k_dense=1,
    moe=MoEConfig(n_experts=4, top_k=2, expert_dim=32, n_shared_experts=1),
)  # fmt: skip


def bf16_model() -> Transformer:
    model = Transformer(MODEL, kernels="torch")
    model.init_weights(torch.Generator().manual_seed(0))
    cast_parameters(model, torch.bfloat16)
    return model


def test_parameters_are_bf16_and_buffers_keep_their_precision():
    model = bf16_model()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    fp32_buffers = {n for n, b in Transformer(MODEL, kernels="torch").named_buffers() if b.dtype == torch.float32}
    assert fp32_buffers == {n for n, b in model.named_buffers() if b.dtype == torch.float32}


def test_bf16_step_runs_fused_paths_without_warnings():
    """Forward and backward under bf16 autocast print no warning (e.g. RMSNorm's dtype-mismatch fallback)."""
    model = bf16_model()
    tokens = torch.randint(0, MODEL.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_BSV = model(tokens[:, :-1])
        loss = F.cross_entropy(logits_BSV.flatten(0, 1).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
    assert logits_BSV.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_bf16_run_lands_near_the_fp32_run(tmp_path, corpus_file):
    """A short run in bf16 (bf16 parameters, fp32 master and grads) ends within 2% of the fp32 held-out loss."""
    common = [
        *TINY_MODEL, "data=text", f"data.path={corpus_file}", "train.steps=30", "train.seq_len=32",
        "train.global_batch=8", "train.micro_batch=8", "train.eval_sequences=16", "train.eval_interval=30",
        "optim.warmup_steps=5", "kernels=torch", "logging.progress=false", "machine.peak_flops=1e12",
    ]  # fmt: skip
    val, info = {}, {}
    for dtype in ("fp32", "bf16"):
        run_dir = tmp_path / dtype
        assert main(["train", *common, f"train.dtype={dtype}", f"run.dir={run_dir}"]) == 0
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        val[dtype] = records[-1]["val_loss"]
        info[dtype] = json.loads((run_dir / "run_info.json").read_text())
    assert val["fp32"] < 5.0, "the run must have learned something for the comparison to mean anything"
    assert abs(val["bf16"] - val["fp32"]) / val["fp32"] < 0.02, val
    n_params = info["fp32"]["params"]["total"]
    for dtype, bytes_per_param in (("fp32", 4), ("bf16", 2)):
        rank = info[dtype]["per_rank"][0]
        assert 0 <= rank["param_bytes"] - rank["padding_bytes"] <= bytes_per_param * n_params <= rank["param_bytes"]
    assert info["bf16"]["per_rank"][0]["master_bytes"] >= 4 * n_params
    assert info["fp32"]["per_rank"][0]["master_bytes"] == 0
