"""End-to-end single-process training through the CLI: run directory contract and a falling loss."""

import json
import math

import yaml

from optimus.cli import main
from tests.conftest import TINY_MODEL

METRIC_KEYS = {
    "step", "loss", "lm_loss", "aux_loss", "grad_norm", "lr", "tokens", "tokens_per_s",
    "tflops_per_device", "mfu", "expert_load_imbalance",
}  # fmt: skip


def run_train(tmp_path, corpus_file, *extra):
    run_dir = tmp_path / "run"
    overrides = [
        *TINY_MODEL, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}",
        "train.seq_len=32", "train.global_batch=8", "train.micro_batch=4", "train.eval_interval=20",
        "train.eval_batches=2", "logging.progress=false", "optim.warmup_steps=5", *extra,
    ]  # fmt: skip
    assert main(["train", *overrides]) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, metrics


def test_short_run_writes_the_contract_and_learns(tmp_path, corpus_file):
    run_dir, metrics = run_train(tmp_path, corpus_file, "train.steps=40", "optim.lr=3e-3")
    assert [m["step"] for m in metrics] == list(range(1, 41))
    for m in metrics:
        assert METRIC_KEYS <= m.keys()
        assert m["tokens"] == m["step"] * 8 * 32
        assert m["expert_load_imbalance"] >= 1.0
        assert m["mfu"] is None or 0 < m["mfu"] < 1
    # Loss falls well below its start (the corpus is highly repetitive).
    first = sum(m["lm_loss"] for m in metrics[:3]) / 3
    last = sum(m["lm_loss"] for m in metrics[-3:]) / 3
    assert last < 0.6 * first
    assert metrics[-1]["val_loss"] < metrics[19]["val_loss"]

    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["layout"] == {"world": 1, "dp": 1, "ep": 1, "accum": 2}
    assert info["params"]["total"] == info["params"]["dense"] + info["params"]["expert"]
    assert info["params_dense"] == info["params"]["dense"]
    rank0 = info["per_rank"][0]
    assert rank0["param_bytes"] == 4 * info["params"]["total"]
    assert rank0["optim_state_bytes"] == 8 * info["params"]["total"]  # fp32 AdamW: two moments

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["steps"] == 40 and config["model"]["moe"]["n_experts"] == 4


def test_lr_schedule_in_metrics(tmp_path, corpus_file):
    _, metrics = run_train(tmp_path, corpus_file, "train.steps=10", "optim.lr=1e-3", "optim.min_lr_ratio=0.1")
    lrs = [m["lr"] for m in metrics]
    assert lrs[:5] == [1e-3 * (i + 1) / 5 for i in range(5)]  # linear warmup
    # Step index 9 (0-based) is 4/5 of the way through the 5 cosine steps.
    assert abs(lrs[-1] - (1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 4 / 5)))) < 1e-12


def test_existing_run_dir_is_refused(tmp_path, corpus_file, capsys):
    run_train(tmp_path, corpus_file, "train.steps=2")
    overrides = [*TINY_MODEL, "data=text", f"data.path={corpus_file}", f"run.dir={tmp_path / 'run'}"]
    assert main(["train", *overrides, "train.steps=2", "logging.progress=false"]) == 2
    assert "already holds a run" in capsys.readouterr().err
