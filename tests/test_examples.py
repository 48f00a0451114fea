"""Every script in examples/ runs, and does what its docstring says (checked against independent facts)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_tested():
    tested = {"moe_in_your_model", "expert_parallel_training", "read_run_metrics"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_moe_in_your_model_learns_what_one_token_can_tell():
    example = load_example("moe_in_your_model")
    losses = example.main([])  # its default number of steps
    # Untrained: a uniform guess over the vocabulary. Trained: the stride (1, 2 or 3, uniform) is all that one
    # token leaves unknown, so the best possible mean loss is ln 3.
    assert losses[0] == pytest.approx(math.log(example.VOCAB), abs=0.1)
    tail = sum(losses[-10:]) / 10
    assert math.log(3) - 0.05 < tail < math.log(3) + 0.15, losses[-10:]


@pytest.mark.slow
def test_expert_parallel_training_matches_one_process():
    example = EXAMPLES / "expert_parallel_training.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks2 = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]

    # The reference: the same script in this process, no process group, every expert local, nothing sharded.
    one_process = load_example("expert_parallel_training").main([])
    assert [r["step"] for r in ranks2] == list(range(1, len(one_process) + 1))
    for record, want in zip(ranks2, one_process):
        assert record["loss"] == pytest.approx(want, rel=1e-5)
    assert ranks2[-1]["loss"] < ranks2[0]["loss"] - 0.3  # it trains


def test_read_run_metrics_reports_the_files(small_run, capsys):
    run_dir, _ = small_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["step"] > 0]  # load_run leaves out the starting evaluation (step 0)
    info = json.loads((run_dir / "run_info.json").read_text())

    example = load_example("read_run_metrics")
    facts = example.describe(str(run_dir))
    assert facts["steps"] == len(records)
    assert (facts["first_loss"], facts["last_loss"]) == (records[0]["loss"], records[-1]["loss"])
    assert facts["evaluations"] == [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    assert facts["params_total"] == info["params"]["total"]
    assert facts["layout"]["world"] == 1

    assert example.main([str(run_dir)]) == 0
    assert f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}" in capsys.readouterr().out


def test_read_run_metrics_explains_a_missing_run(tmp_path, capsys):
    assert load_example("read_run_metrics").main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
