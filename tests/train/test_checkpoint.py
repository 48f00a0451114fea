"""Checkpoints of one process: publish and retention, auto-resume after SIGKILL (bit for bit), a kill
during a save, fallback from a corrupted checkpoint, weights-only starts, async saves, and export.

Resharding across layouts is in test_checkpoint_reshard.py, signals and non-finite steps in test_faults.py.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

from optimus.cli import load_config, main
from optimus.model import Transformer
from optimus.train.checkpoint_dirs import candidates, inspect
from optimus.train.dcp_warning import no_single_process_warning
from optimus.train.trainer import Trainer
from tests.conftest import SMALL_MODEL_RUN

STEPS = 6
COMMON = [
    *SMALL_MODEL_RUN,
    "model.moe.router=sigmoid",
    "model.moe.bias_update_rate=0.01",
    "train.micro_batch=4",
    "train.eval_sequences=8",
    "train.eval_interval=3",
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    "checkpoint.interval=2",
    "checkpoint.keep=2",
]


def overrides(corpus_file, run_dir, *extra) -> list[str]:
    return [*COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", f"train.steps={STEPS}", *extra]


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trajectory(metrics: list[dict]) -> list[tuple]:
    """What must repeat exactly (timings excluded)."""
    keys = ("step", "loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "lr", "expert_load_imbalance", "val_loss")
    return [tuple(m.get(k) for k in keys) for m in metrics]


def load_everything(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model, optimizer, trainer counters, RNG), read in one process."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in saved.items()}
    with no_single_process_warning():
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return out


def assert_same_checkpoint(a, b) -> None:
    """Bit-equal tensors, RNG states aside: nothing in training draws from the global RNG, so its state
    depends on what else the process did (test_resume_restores_counters_and_rng checks its restore)."""
    ta, tb = load_everything(a), load_everything(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        if not key.startswith("rng/"):
            assert torch.equal(ta[key], tb[key]), key


def train_cmd(corpus_file, run_dir, *extra) -> list[str]:
    return [sys.executable, "-m", "optimus", "train", *overrides(corpus_file, run_dir, *extra)]


def subprocess_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_file):
    """One uninterrupted in-process run, with its live final model state as the reference."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    trainer = Trainer.from_config(load_config(overrides(corpus_file, run_dir)))
    trainer.fit()
    live = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return run_dir, live, trainer.cfg


def test_publish_latest_and_keep(trained):
    run_dir, _, _ = trained
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004", "step_000006"]  # keep=2
    assert (root / "latest").read_text().strip() == "step_000006"
    meta = json.loads((root / "step_000006" / "meta.json").read_text())
    assert meta["step"] == STEPS and meta["world"] == 1
    assert (root / "step_000006" / "config.yaml").is_file()
    state = load_everything(root / "step_000006")
    assert int(state["trainer/step"]) == STEPS and int(state["trainer/samples_consumed"]) == STEPS * 8
    assert int(state["optim/step"]) == STEPS
    assert "model/layers.0.ffn.experts.w13/expert_3" in state and "rng/cpu/rank_0" in state


def test_export_is_the_full_model_with_its_config(trained, tmp_path):
    run_dir, live, cfg = trained
    out = tmp_path / "export" / "model.safetensors"
    assert main(["checkpoint", "export", str(run_dir / "checkpoints"), "--out", str(out)]) == 0
    exported = load_file(str(out))
    assert exported.keys() == live.keys()
    for key in live:
        assert torch.equal(exported[key], live[key]), key
    assert exported["layers.1.ffn.experts.w2"].shape == (4, 32, 32)  # [E, F, D]
    model = Transformer(cfg.model)
    model.load_state_dict(exported, strict=True)
    with safe_open(str(out), "pt") as f:
        config_yaml = f.metadata()["optimus_config"]
    assert "n_experts: 4" in config_yaml and out.with_suffix(".yaml").read_text() == config_yaml


def test_load_weights_only_starts_a_new_run(trained, tmp_path, corpus_file):
    run_dir, live, _ = trained
    source = f"checkpoint.load={run_dir / 'checkpoints' / 'step_000006'}"
    weights_only = overrides(corpus_file, tmp_path / "new", source, "checkpoint.load_weights_only=true")
    trainer = Trainer.from_config(load_config(weights_only))
    try:
        for key, value in trainer.model.state_dict().items():
            assert torch.equal(value, live[key]), key  # router biases included
        assert trainer.step == 0 and trainer.loader.state_dict()["samples_consumed"] == 0
        assert trainer.optimizer.step_count == 0  # fresh AdamW state
        assert all(torch.count_nonzero(s["exp_avg"]) == 0 for s in trainer.optimizer.rule.state.values())
    finally:
        trainer.loader.close()


def test_resume_restores_counters_and_rng(trained, tmp_path, corpus_file):
    run_dir = tmp_path / "run"
    shutil.copytree(trained[0], run_dir)
    saved = load_everything(run_dir / "checkpoints" / "step_000006")
    trainer = Trainer.from_config(load_config(overrides(corpus_file, run_dir, "train.steps=8")))
    try:
        assert trainer.step == STEPS and trainer.tokens_seen == STEPS * 8 * 16
        assert trainer.loader.state_dict()["samples_consumed"] == STEPS * 8
        assert trainer.optimizer.step_count == STEPS
        assert torch.equal(torch.get_rng_state(), saved["rng/cpu/rank_0"])
    finally:
        trainer.loader.close()


def test_explicit_load_errors_are_config_errors(trained, tmp_path, corpus_file, capsys):
    run_dir, _, _ = trained
    missing = overrides(corpus_file, tmp_path / "a", f"checkpoint.load={tmp_path / 'nowhere'}")
    assert main(["train", *missing]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
    other_model = overrides(corpus_file, tmp_path / "b", f"checkpoint.load={run_dir / 'checkpoints'}", "model.dim=48")
    assert main(["train", *other_model]) == 2
    assert "model.dim changed from 32 to 48 since the checkpoint" in capsys.readouterr().err


def test_inspect_finds_damaged_checkpoints(trained, tmp_path):
    good = trained[0] / "checkpoints" / "step_000006"
    assert inspect(good)[0] is None
    cases = {
        "meta.json": lambda d: (d / "meta.json").unlink(),
        ".metadata is unreadable": lambda d: (d / ".metadata").write_bytes(b"\x00garbage"),
        "__0_0.distcp is missing": lambda d: (d / "__0_0.distcp").unlink(),
        "truncated": lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:1000]),
    }
    for expected, damage in cases.items():
        broken = tmp_path / expected.replace(" ", "_") / "step_000006"
        shutil.copytree(good, broken)
        damage(broken)
        problem, _ = inspect(broken)
        assert problem is not None and expected in problem, problem


def test_corrupted_latest_falls_back_to_the_previous_one(trained, tmp_path, corpus_file, caplog):
    source, _, _ = trained
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    reference = read_metrics(run_dir)
    data = run_dir / "checkpoints" / "step_000006" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # a torn write of the newest checkpoint
    with caplog.at_level(logging.WARNING, logger="optimus.checkpoint"):
        assert main(["train", *overrides(corpus_file, run_dir)]) == 0
    assert "step_000006 cannot be loaded" in caplog.text and "truncated" in caplog.text
    assert "Resuming from" in caplog.text and "step_000004 (step 4;" in caplog.text
    assert trajectory(read_metrics(run_dir)) == trajectory(reference)  # steps 5-6 re-done identically
    assert inspect(run_dir / "checkpoints" / "step_000006")[0] is None  # and saved again, whole


def test_async_save_writes_the_same_checkpoints(trained, tmp_path, corpus_file):
    source, _, _ = trained
    run_dir = tmp_path / "run"
    assert main(["train", *overrides(corpus_file, run_dir, "checkpoint.async_save=true")]) == 0
    assert trajectory(read_metrics(run_dir)) == trajectory(read_metrics(source))
    for name in ("step_000004", "step_000006"):
        assert_same_checkpoint(run_dir / "checkpoints" / name, source / "checkpoints" / name)
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def wait_for_step(proc: subprocess.Popen, run_dir, step: int, timeout_s: float = 120) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) > step):  # after step 0's line
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "the run did not reach the step in time"
        time.sleep(0.02)


def test_sigkill_then_the_same_command_continues_bit_for_bit(tmp_path, corpus_file):
    # Any step must do (printed on failure); from step 3 on, the step-2 checkpoint exists to resume from.
    kill_after = random.SystemRandom().randint(3, STEPS - 1)
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    reference = subprocess.Popen(train_cmd(corpus_file, reference_dir), env=subprocess_env(), stdout=subprocess.DEVNULL)
    victim = subprocess.Popen(train_cmd(corpus_file, run_dir), env=subprocess_env(), stdout=subprocess.DEVNULL)
    try:
        wait_for_step(victim, run_dir, kill_after)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        assert reference.wait(timeout=300) == 0
    finally:
        reference.kill()
        victim.kill()
    assert victim.returncode == -signal.SIGKILL
    resumed = subprocess.run(train_cmd(corpus_file, run_dir), env=subprocess_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming from" in resumed.stderr
    assert trajectory(read_metrics(run_dir)) == trajectory(read_metrics(reference_dir)), f"killed after {kill_after}"
    final = "step_000006"
    assert_same_checkpoint(run_dir / "checkpoints" / final, reference_dir / "checkpoints" / final)


DIE_IN_SAVE = """
import os, sys
import torch.distributed.checkpoint as dcp
from optimus.cli import main

real_finish = dcp.FileSystemWriter.finish

def finish_or_die(self, metadata, results):
    if "step_000004" in str(self.path):
        os._exit(9)  # every rank's data is written, .metadata is not: the job dies mid-save
    return real_finish(self, metadata, results)

dcp.FileSystemWriter.finish = finish_or_die
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path, corpus_file, caplog):
    run_dir = tmp_path / "run"
    died = subprocess.run(
        [sys.executable, "-c", DIE_IN_SAVE, *overrides(corpus_file, run_dir)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert died.returncode == 9, died.stderr
    root = run_dir / "checkpoints"
    assert (root / "step_000004.tmp").is_dir() and not (root / "step_000004").exists()
    assert (root / "latest").read_text().strip() == "step_000002"
    assert candidates(root) == [root / "step_000002"]
    with caplog.at_level(logging.WARNING, logger="optimus.checkpoint"):
        assert main(["train", *overrides(corpus_file, run_dir)]) == 0
    assert "step_000002 (step 2;" in caplog.text
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(0, STEPS + 1))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004", "step_000006"]
