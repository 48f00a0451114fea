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
        "train.eval_sequences=8", "logging.progress=false", "optim.warmup_steps=5", *extra,
    ]  # fmt: skip
    assert main(["train", *overrides]) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, metrics


def test_short_run_writes_the_contract_and_learns(tmp_path, corpus_file):
    run_dir, records = run_train(tmp_path, corpus_file, "train.steps=40", "optim.lr=3e-3")
    assert [m["step"] for m in records] == list(range(0, 41))
    start, metrics = records[0], records[1:]  # the held-out loss before training, then the steps
    assert start.keys() == {"step", "tokens", "val_loss", "val_sequences"} and start["tokens"] == 0
    assert start["val_sequences"] == 8 and all(m["val_sequences"] == 8 for m in records if "val_loss" in m)
    assert abs(start["val_loss"] - math.log(512)) < 0.1  # an untrained model's near-uniform prediction
    for m in metrics:
        assert METRIC_KEYS <= m.keys()
        assert m["tokens"] == m["step"] * 8 * 32
        assert m["expert_load_imbalance"] >= 1.0
        # each MoE layer's row counts every token of the global batch (8 x 32) once per chosen expert (top_k 2)
        assert [sum(row) for row in m["expert_tokens"]] == [8 * 32 * 2] * 2
        assert m["mfu"] is None or 0 < m["mfu"] < 1
    # Loss falls well below its start (the corpus is highly repetitive).
    first = sum(m["lm_loss"] for m in metrics[:3]) / 3
    last = sum(m["lm_loss"] for m in metrics[-3:]) / 3
    assert last < 0.6 * first
    assert metrics[-1]["val_loss"] < metrics[19]["val_loss"]

    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["layout"] == {"world": 1, "pp": 1, "dp": 1, "tp": 1, "ep": 1, "edp": 1, "accum": 2, "shard_ranks": None}
    assert info["moe_layers"] == [0, 1] and all(len(m["expert_tokens"]) == 2 for m in metrics)
    assert info["params"]["total"] == info["params"]["dense"] + info["params"]["expert"]
    assert info["params_dense"] == info["params"]["dense"]
    rank0 = info["per_rank"][0]
    total, pad = info["params"]["total"], rank0["padding_bytes"]
    param_size = {"fp32": 4, "bf16": 2}[info["dtypes"]["param"]]  # train.dtype=auto: bf16 only on bf16 CPUs
    assert 0 <= rank0["param_bytes"] - param_size * total <= pad
    assert 0 <= rank0["optim_state_bytes"] - 8 * total <= pad  # two fp32 AdamW moments

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["steps"] == 40 and config["model"]["moe"]["n_experts"] == 4


def test_lr_schedule_in_metrics(tmp_path, corpus_file):
    _, metrics = run_train(tmp_path, corpus_file, "train.steps=10", "optim.lr=1e-3", "optim.min_lr_ratio=0.1")
    lrs = [m["lr"] for m in metrics[1:]]  # after the starting evaluation
    assert lrs[:5] == [1e-3 * (i + 1) / 5 for i in range(5)]  # linear warmup, peak at the last warmup step
    # The 5 decay steps are 1/5, 2/5, ..., 5/5 of the way down the cosine: the last one is the floor.
    for i, lr in enumerate(lrs[5:]):
        assert abs(lr - (1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * (i + 1) / 5)))) < 1e-12
    assert abs(lrs[-1] - 1e-4) < 1e-12


def test_existing_run_dir_is_refused(tmp_path, corpus_file, capsys):
    run_train(tmp_path, corpus_file, "train.steps=2")
    overrides = [*TINY_MODEL, "data=text", f"data.path={corpus_file}", f"run.dir={tmp_path / 'run'}"]
    assert main(["train", *overrides, "train.steps=2", "logging.progress=false"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_an_empty_metrics_file_does_not_block_the_run_dir(tmp_path, corpus_file):
    """A run that died before its first step leaves an empty metrics.jsonl; the same command runs again."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    _, metrics = run_train(tmp_path, corpus_file, "train.steps=2")
    assert [m["step"] for m in metrics] == [0, 1, 2]


def test_a_run_that_died_after_its_starting_evaluation_runs_again(tmp_path, corpus_file):
    """A run that died in its first step has written the starting evaluation only (step 0): that is no run to
    keep, so the same command runs again, and writes its own step 0 in place of the old one."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "tokens": 0, "val_loss": 99.0}\n')
    _, metrics = run_train(tmp_path, corpus_file, "train.steps=2")
    assert [m["step"] for m in metrics] == [0, 1, 2] and metrics[0]["val_loss"] != 99.0


def test_diverging_run_ends_with_one_sentence_and_keeps_its_records(tmp_path, corpus_file, monkeypatch, capsys):
    import optimus.train.step as step_module

    real_loss = step_module.micro_batch_loss

    def nan_loss(*args):
        return real_loss(*args) + float("nan")

    monkeypatch.setattr(step_module, "micro_batch_loss", nan_loss)
    run_dir = tmp_path / "run"
    overrides = [*TINY_MODEL, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", "train.seq_len=32",
                 "train.steps=5", "train.max_skipped_steps=1", "logging.progress=false"]  # fmt: skip
    assert main(["train", *overrides]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("optimus: error: 2 steps in a row were skipped") and "\n" not in error
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m.get("skipped")) for m in metrics] == [(0, None), (1, True), (2, True)]


def test_resume_hint_names_the_run_dir_the_run_chose():
    from pathlib import Path

    from optimus.cli import load_config
    from optimus.train.run_dir import resume_hint

    cfg = load_config([])  # run.dir unset: a rerun would pick a new timestamped directory
    assert (
        resume_hint(cfg, Path("/scratch/runs/tiny-1"))
        == "run the same command with run.dir=/scratch/runs/tiny-1 to resume"
    )
    cfg = load_config(["run.dir=/scratch/runs/tiny-1"])
    assert resume_hint(cfg, Path("/scratch/runs/tiny-1")) == "run the same command again to resume"
    cfg = load_config(["run.dir=/scratch/runs/tiny-1", "run.overwrite=true"])  # which would start it over
    assert (
        resume_hint(cfg, Path("/scratch/runs/tiny-1"))
        == "run the same command again but without run.overwrite=true to resume"
    )
