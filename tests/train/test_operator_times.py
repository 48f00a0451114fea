"""`profile.operators`: every operator of a window of steps timed inside the step, by the signature the
performance model replays (optimus/train/operator_times.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from optimus.operators import op_signature
from optimus.train.operator_times import FORMAT, OperatorTimes
from tests.train.test_timers import RUN, fit

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (see tests/conftest.py)


def test_the_windows_operators_are_counted_by_signature(tmp_path):
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    times = OperatorTimes(True, "2-3", tmp_path, rank=1, device_type="cpu")
    for step in (1, 2, 3, 4):
        times.before_step(step)
        torch.mm(a, b)
        if step in (2, 3):
            torch.mm(a, b)
            a.sum()
        times.after_step(step)
    out = json.loads((tmp_path / "operators" / "rank1.json").read_text())
    assert out["format"] == FORMAT and out["steps"] == [2, 3] and len(out["step_wall_s"]) == 2
    mm = op_signature(torch.ops.aten.mm.default, (a, b), {})
    total = op_signature(torch.ops.aten.sum.default, (a,), {})
    assert set(out["operators"]) == {mm, total}  # steps 1 and 4 are outside the window
    assert out["operators"][mm][0] == 2 and out["operators"][total][0] == 1  # calls per step
    # Seconds per step are the window's mean, so they are bounded by the mean step (the first step, which
    # enters the timing mode, can take forty times the second's).
    seconds_per_step = sum(seconds for _, seconds in out["operators"].values())
    assert 0 < out["operators"][mm][1] < seconds_per_step < sum(out["step_wall_s"]) / 2


def test_a_run_that_ends_inside_the_window_writes_what_it_timed(tmp_path):
    times = OperatorTimes(True, "1-5", tmp_path, rank=0, device_type="cpu")
    times.before_step(1)
    torch.ones(3).add(1)
    times.after_step(1)
    times.before_step(2)  # the run stops in its second step
    times.close()
    out = json.loads((tmp_path / "operators" / "rank0.json").read_text())
    assert out["steps"] == [1, 1] and len(out["step_wall_s"]) == 1
    torch.ones(3).add(1)  # the timing is off again
    assert json.loads((tmp_path / "operators" / "rank0.json").read_text()) == out


def test_training_with_operator_times(tmp_path, corpus_file):
    # The second step's operators: its forward's products, its backward's and the optimizer's update, none of
    # them longer in all than the step.
    run_dir = tmp_path / "run"
    overrides = [*RUN, f"data.path={corpus_file}", f"run.dir={run_dir}", "profile.operators=true",
                 "profile.torch_steps=2-2"]  # fmt: skip
    fit(overrides, os.environ["OPTIMUS_CACHE"])
    out = json.loads((run_dir / "operators" / "rank0.json").read_text())
    names = {json.loads(sig)[0] for sig in out["operators"] if sig.startswith("[")}
    assert {"aten.mm.default", "aten._fused_adamw_.default"} <= names
    assert 0 < sum(seconds for _, seconds in out["operators"].values()) < out["step_wall_s"][0]
