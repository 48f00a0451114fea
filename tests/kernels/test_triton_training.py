"""A training run with kernels=triton (under the Triton interpreter on CPU) matches kernels=torch step for step."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the triton backend is optional")

SMALL = [
    "optim.update=adamw",  # the backends agree within fp32 rounding; Muon's bf16 iteration would round apart
    "model.n_layers=2", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_dim=64",
    "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_dim=32", "model.vocab_size=512",
    "data.vocab_size=512", "train.seq_len=16", "train.global_batch=4", "train.micro_batch=2", "train.steps=3",
    "train.eval_sequences=4", "train.dtype=fp32", "logging.progress=false",
]  # fmt: skip


def train_metrics(tmp_path, corpus_file, kernels: str) -> list[dict]:
    run_dir = tmp_path / kernels
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "optimus", "train", *SMALL, "data=text", f"data.path={corpus_file}",
               f"kernels={kernels}", f"run.dir={run_dir}"]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["kernels"] == kernels
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["step"] > 0]  # the steps, without the starting evaluation


@pytest.mark.slow
def test_triton_backend_trains_like_torch_backend(tmp_path, corpus_file):
    torch_run = train_metrics(tmp_path, corpus_file, "torch")
    triton_run = train_metrics(tmp_path, corpus_file, "triton")
    assert len(torch_run) == len(triton_run) == 3
    for a, b in zip(torch_run, triton_run):
        for key in ("loss", "lm_loss", "aux_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
