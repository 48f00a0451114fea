"""The wait for the slowest rank (optimus.perf.stragglers): the expected maximum against a closed form and a
Monte Carlo draw, and a prediction's step and split with it, worked by hand from the step without it."""

from __future__ import annotations

import math

import pytest
import torch

from optimus.perf.machine import machine_model
from optimus.perf.predict import prediction_of, trace_step
from optimus.perf.stragglers import expected_max_of_normals
from optimus.recipes import load_config
from tests.conftest import TINY_MODEL


def test_the_expected_maximum_of_normal_ranks():
    assert expected_max_of_normals(1) == 0.0
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)  # closed forms
    assert expected_max_of_normals(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-6)
    draws = torch.randn(4000, 3072, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for n in (16, 256, 3072):
        sampled = draws[:, :n].max(dim=1).values.mean().item()
        assert expected_max_of_normals(n) == pytest.approx(sampled, rel=0.01), n


def test_a_step_waits_for_its_slowest_rank():
    # Frontier at 2 nodes (16 ranks): with every rank's step varying by 2%, the step is the replayed one times
    # 1 + 0.02 x E[max of 16], and the split names the wait; the interval's slow end takes the range's high end.
    overrides = [*TINY_MODEL, "machine=frontier", "train.seq_len=32", "train.global_batch=32", "train.micro_batch=2",
                 "parallel.ep=4"]  # fmt: skip
    cfg = load_config(overrides)
    traces = trace_step(cfg, 16, progress="none")
    still = load_config([*overrides, "machine.perf.rank_variability=null", "~machine.perf.ranges.rank_variability"])
    base = prediction_of(still, 16, machine_model(still.machine, 16), traces)
    noisy = load_config([*overrides, "machine.perf.rank_variability=0.02"])
    pred = prediction_of(noisy, 16, machine_model(noisy.machine, 16), traces)
    wait = base.step_time_s * 0.02 * expected_max_of_normals(16)
    assert pred.step_time_s == pytest.approx(base.step_time_s + wait)
    assert pred.time_split["stragglers"] == pytest.approx(wait)
    assert "stragglers" not in base.time_split
    assert sum(pred.time_split.values()) == pytest.approx(pred.step_time_s)
    assert pred.step_time_s_range[1] > pred.step_time_s  # the slow end: 5% variability among the rest
