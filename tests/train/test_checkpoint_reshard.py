"""Resharding: a checkpoint written by world 4 (EP 2, EP-aware sharded optimizer) continues the same
trajectory under other layouts and optimizer schemes (relative 1e-5 in fp32).

The reference run saves at step 2 (in the background: checkpoint.async_save) and goes
on to step 4; each other layout starts from its step-2 checkpoint (checkpoint.load) and
must reproduce steps 3-4: losses, gradient norms, and the final parameters (compared
through the export's consolidation). The standard scheme with EP 2 writes its dense
optimizer shards from both EP ranks under the same keys (DCP keeps one).
The sigmoid router makes the router biases (model buffers) part of what must carry over.
Hierarchical sharding (optim.shard_ranks): the reference's checkpoint continues with the state in shard groups
of 2, and one written with shard groups of 2 (each shard written once, though two ranks hold it) continues in 2
pipeline stages with shard_ranks=1.

Pipeline stages: a checkpoint written at pp=2 (EP 2, ZeRO-2, 1F1B) continues the same
trajectory at pp=1 (one process) and at pp=4 (GPipe): a layer's keys carry its global
index, whichever stage held it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from optimus.checkpoint_export import consolidated_state
from tests.conftest import TINY_MODEL
from tests.distributed import run_distributed

COMMON = [
    *TINY_MODEL,
    "model.dim=32",
    "model.moe.expert_dim=32",
    "model.moe.router=sigmoid",
    "model.moe.bias_update_rate=0.01",
    "train.dtype=fp32",
    "kernels=torch",
    "logging.progress=false",
    "train.steps=4",
    "train.seq_len=16",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.eval_sequences=16",
    "train.eval_interval=100",
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    "parallel.timeout_s=60",
    "checkpoint.interval=2",
    "checkpoint.keep=5",
]


def train_rank(overrides: list[str], cache: str) -> int:
    """Body of one rank (also run in-process for world 1): compose the config and train."""
    os.environ["OPTIMUS_CACHE"] = cache
    torch.set_num_threads(1)
    from optimus.cli import load_config
    from optimus.train.trainer import Trainer

    return Trainer.from_config(load_config(overrides)).fit()["steps"]


def run(overrides: list[str], world: int, cache: str) -> None:
    if world == 1:
        train_rank(overrides, cache)
    else:
        assert run_distributed(train_rank, world, overrides, cache, timeout_s=240) == [4] * world


def reference_run(tmp_path_factory, corpus_file, name: str, layout: list[str]):
    """(run directory, cache) of a 4-rank run of `layout` on the test corpus, saved at step 2 and continued,
    uninterrupted, to step 4."""
    cache = str(tmp_path_factory.getbasetemp() / "optimus-cache")
    run_dir = tmp_path_factory.mktemp(name) / "reference"
    run([*COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", *layout], 4, cache)
    return run_dir, cache


def continue_run(reference, corpus_file, run_dir, world: int, layout: list[str]) -> None:
    """A run of `layout` on `world` ranks from `reference`'s step-2 checkpoint, into `run_dir`, checked against the
    reference's steps 3 and 4 (assert_continues)."""
    ref_dir, cache = reference
    load = f"checkpoint.load={ref_dir / 'checkpoints' / 'step_000002'}"
    run([*COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", *layout, load], world, cache)
    assert_continues(run_dir, ref_dir)


def read_metrics(run_dir) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_file):
    layout = ["parallel.nproc=4", "parallel.ep=2", "optim.sharding=ep_aware", "checkpoint.async_save=true"]
    return reference_run(tmp_path_factory, corpus_file, "reshard", layout)


@pytest.mark.parametrize(
    "world,ep,sharding,shard_ranks",
    [(4, 4, "ep_aware", None), (2, 2, "standard", None), (1, 1, "none", None), (4, 2, "ep_aware", 2)],
    ids=["world4-ep4-ep_aware", "world2-ep2-standard", "world1-none", "world4-ep2-shard_ranks2"],
)
def test_checkpoint_continues_under_another_layout(reference, corpus_file, tmp_path, world, ep, sharding, shard_ranks):
    layout = [f"parallel.nproc={world}", f"parallel.ep={ep}", f"optim.sharding={sharding}"]
    layout += [f"optim.shard_ranks={shard_ranks}"] if shard_ranks else []
    continue_run(reference, corpus_file, tmp_path / "run", world, layout)


@pytest.fixture(scope="module")
def hierarchical_reference(tmp_path_factory, corpus_file):
    """A world-4 run with optim.shard_ranks=2 (ep 1: dense and expert state each split over 2 ranks and replicated
    over 2), saved at step 2 and continued, uninterrupted, to step 4."""
    layout = ["parallel.nproc=4", "optim.sharding=ep_aware", "optim.shard_ranks=2", "optim.zero=2"]
    return reference_run(tmp_path_factory, corpus_file, "reshard_hierarchical", layout)


def checkpoint_bytes(step_dir) -> int:
    return sum(f.stat().st_size for f in step_dir.glob("*.distcp"))


def test_hierarchical_checkpoint_is_written_once_and_continues_in_pipeline_stages(
    hierarchical_reference, reference, corpus_file, tmp_path
):
    """The replicas of each shard write the same keys, which DCP writes once: the checkpoint is no larger than
    one saved with the state split over all 4 ranks (with both copies its optimizer state would be twice that).
    It continues in 2 pipeline stages of 2 ranks with shard_ranks=1 (every rank holding all of its stage's state,
    summed over its stage's other rank)."""
    step = "checkpoints/step_000002"
    assert checkpoint_bytes(hierarchical_reference[0] / step) < 1.05 * checkpoint_bytes(reference[0] / step)
    layout = ["parallel.nproc=4", "parallel.pp=2", "optim.sharding=standard", "optim.shard_ranks=1"]
    continue_run(hierarchical_reference, corpus_file, tmp_path / "run", 4, layout)


PIPELINE = ["model.n_layers=4", "optim.zero=2"]  # 4 layers: pp=4 puts one on each stage


def assert_continues(run_dir, ref_dir) -> None:
    """Steps 3-4 and the final parameters of `run_dir` (started from step 2) equal those of the reference."""
    ref_metrics, metrics = read_metrics(ref_dir), read_metrics(run_dir)
    assert sorted(ref_metrics) == [0, 1, 2, 3, 4]  # step 0: the starting evaluation
    assert sorted(metrics) == [3, 4]  # the run started at the checkpoint's step
    for step in (3, 4):
        for key in ("loss", "lm_loss", "aux_loss", "grad_norm", "expert_load_imbalance"):
            assert metrics[step][key] == pytest.approx(ref_metrics[step][key], rel=1e-5), (step, key)
        assert metrics[step]["lr"] == ref_metrics[step]["lr"]  # the schedule continues from step 2
    final = consolidated_state(run_dir / "checkpoints" / "step_000004")
    expected = consolidated_state(ref_dir / "checkpoints" / "step_000004")
    assert final.keys() == expected.keys()
    assert any(t.abs().sum() > 0 for k, t in expected.items() if k.endswith("expert_bias"))  # biases moved
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def pipeline_reference(tmp_path_factory, corpus_file):
    """A pp=2 run saved at step 2 and continued, uninterrupted, to step 4."""
    layout = [*PIPELINE, "parallel.nproc=4", "parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=1f1b"]
    return reference_run(tmp_path_factory, corpus_file, "reshard_pp", layout)


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout",
    [(1, []), (4, ["parallel.pp=4", "parallel.pp_schedule=gpipe"])],
    ids=["pp2-to-pp1", "pp2-to-pp4"],
)
def test_pipeline_checkpoint_continues_under_another_stage_split(
    pipeline_reference, corpus_file, tmp_path, world, layout
):
    continue_run(
        pipeline_reference, corpus_file, tmp_path / "run", world, [*PIPELINE, f"parallel.nproc={world}", *layout]
    )
