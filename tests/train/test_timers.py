"""Step-time breakdown: exclusive phase timers, and the keys a training run writes with and without them."""

from __future__ import annotations

import json
import os

import pytest

from optimus.cli import load_config
from optimus.config import ConfigError
from optimus.config_checks import parse_step_window
from optimus.optim.shard_group import GRAD_REDUCE, GRAD_REDUCE_WAIT, PARAM_GATHER
from optimus.train import timers as timers_module
from optimus.train.timers import Timers
from optimus.train.trainer import Trainer
from tests.conftest import TINY_MODEL
from tests.distributed import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (see tests/conftest.py)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_exclusive_times_and_synchronisation(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timers_module.time, "perf_counter", clock)
    syncs = []
    timers = Timers(True, lambda: syncs.append(clock.now))
    with timers("forward"):
        clock.now += 1.0
        with timers("dispatch_comm"):
            clock.now += 0.25
        clock.now += 0.5
        with timers("combine_comm"):
            clock.now += 0.125
    with timers("forward"):  # a second micro-batch adds to the same phase
        clock.now += 2.0
    assert timers.pop_totals() == {
        "time_forward_s": 3.5,
        "time_dispatch_comm_s": 0.25,
        "time_combine_comm_s": 0.125,
    }
    assert len(syncs) == 8  # before and after each of the four phases
    assert timers.pop_totals() == {}  # popped totals start again from zero


def test_disabled_timers_record_nothing_and_never_synchronise():
    syncs = []
    timers = Timers(False, lambda: syncs.append(1))
    with timers("forward"):
        pass
    assert not timers and timers.pop_totals() == {} and syncs == []


def test_step_window():
    assert parse_step_window("3-5") == (3, 5)
    assert parse_step_window("4") == (4, 4)
    for bad in ("5-3", "0-2", "a-b", ""):
        with pytest.raises(ConfigError, match="profile.torch_steps"):
            parse_step_window(bad)


RUN = [
    *TINY_MODEL, "data=text", "train.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=2",
    "train.eval_sequences=4", "machine.peak_flops=1e12", "logging.progress=false",
]  # fmt: skip
TRAINER_PHASES = {"data_wait", "forward", "backward", "optimizer"}
COMM_PHASES = {"dispatch_comm", "combine_comm", "grad_reduce", "param_gather"}


def fit(overrides: list[str], cache: str) -> None:
    os.environ["OPTIMUS_CACHE"] = cache  # forked ranks share the test session's tokenizer cache
    Trainer.from_config(load_config(overrides)).fit()


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def phases(record: dict) -> set[str]:
    return {k[len("time_") : -len("_s")] for k in record if k.startswith("time_") and k.endswith("_s")}


def test_training_without_timers_writes_no_breakdown(tmp_path, corpus_file):
    run_dir = tmp_path / "run"
    fit([*RUN, f"data.path={corpus_file}", f"run.dir={run_dir}"], os.environ["OPTIMUS_CACHE"])
    for record in read_metrics(run_dir)[1:]:  # the steps, after the starting evaluation
        assert phases(record) == set() and record["step_time_s"] > 0
    assert not list(run_dir.glob("trace_rank*.json"))


def test_expert_parallel_training_writes_every_phase_and_a_trace(tmp_path, corpus_file):
    run_dir = tmp_path / "run"
    overrides = [
        *RUN, f"data.path={corpus_file}", f"run.dir={run_dir}", "parallel.ep=2", "optim.sharding=ep_aware",
        "optim.zero=2", "profile.timers=true", "profile.torch=true", "profile.torch_steps=2-2",
    ]  # fmt: skip
    run_distributed(fit, 2, overrides, os.environ["OPTIMUS_CACHE"])
    for record in read_metrics(run_dir)[1:]:  # the steps, after the starting evaluation
        assert phases(record) == TRAINER_PHASES | COMM_PHASES
        timed = sum(record[f"time_{p}_s"] for p in phases(record))
        assert 0 < timed <= record["step_time_s"]  # exclusive phases never add up to more than the step
    for rank in range(2):
        trace = json.loads((run_dir / f"trace_rank{rank}.json").read_text())
        # The sharded optimizer's collectives sit in their named ranges (benchmarks/overlap.py reads them).
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {GRAD_REDUCE, GRAD_REDUCE_WAIT, PARAM_GATHER} <= names
