"""Pipeline parallelism: stage cutting, and the oracle through the real CLI (4 processes, fp32).

Every pipeline layout must reproduce the single-process trajectory (per-step loss, LM loss,
router losses, grad norm, expert load, held-out loss) within relative 1e-5, as every other
layout does (ARCHITECTURE.md's invariant).
"""

from __future__ import annotations

import json

import pytest

from optimus.cli import load_config, main
from optimus.config import ConfigError, validate
from optimus.parallel.pipeline import rank_stage_indices, stage_layer_ids
from optimus.parallel.state import ParallelState, edp_group_ranks, pp_group_ranks, stage_group_ranks
from tests.conftest import TINY_MODEL

STEPS = 8
COMMON = [
    *TINY_MODEL,
    "model.n_layers=4",
    "model.dim=32",
    "model.moe.expert_dim=32",
    "model.moe.n_shared_experts=1",
    "model.moe.z_loss_coef=0.01",
    "train.dtype=fp32",
    "kernels=torch",
    "logging.progress=false",
    f"train.steps={STEPS}",
    f"train.eval_interval={STEPS // 2}",
    "train.seq_len=16",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.eval_sequences=6",
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    "optim.zero=1",
    "parallel.timeout_s=60",
]


def test_stages_cut_layers_evenly_and_loop_over_ranks():
    assert stage_layer_ids(4, 2) == [[0, 1], [2, 3]]
    assert stage_layer_ids(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert rank_stage_indices(1, pp=2, pp_virtual=2) == [1, 3]
    with pytest.raises(ConfigError, match="cannot fill 4 pipeline stages"):
        stage_layer_ids(3, 4)


def test_pp_is_the_outermost_rank_dimension():
    """world 8 = pp 2 x dp 2 x ep 2: a stage is a run of 4 ranks, EDP groups stay inside their stage."""
    assert stage_group_ranks(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert pp_group_ranks(8, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert edp_group_ranks(8, 2, pp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    ps = ParallelState(rank=6, world_size=8, ep=2, pp=2)
    assert (ps.pp_rank, ps.stage_size, ps.dp, ps.dp_rank, ps.ep_rank) == (1, 4, 2, 1, 0)
    stage = ps.stage()  # the stage as a world of its own, for the optimizer and the data loader
    assert (stage.rank, stage.world_size, stage.pp, stage.dp, stage.dp_rank, stage.ep_rank) == (2, 4, 1, 2, 1, 0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], "needs parallel.pp_virtual >= 2"),
        (["parallel.pp=2", "parallel.pp_virtual=2"], "needs parallel.pp_schedule=interleaved_1f1b"),
        (["parallel.pp=3"], "does not divide the world size 4"),
        (["parallel.pp=2", "model.tie_embeddings=true"], "set model.tie_embeddings=false"),
        (["parallel.pp=2", "optim.zero=2"], "set optim.zero=1"),
        (["parallel.pp=2", "checkpoint.interval=10"], "set checkpoint.interval=0"),
        (["parallel.pp=4", "train.global_batch=4"], "needs a multiple of parallel.pp=4 micro-batches"),
        (["parallel.pp=2", "parallel.pp_schedule=zero"], "parallel.pp_schedule='zero' is not supported"),
    ],
)
def test_pipeline_layouts_that_cannot_run_are_config_errors(overrides, message):
    cfg = load_config([*COMMON, *overrides])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 4)


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def single_threaded(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 4 ranks share 2 cores


@pytest.mark.slow
def test_pipeline_layouts_match_single_process(tmp_path, corpus_file, single_threaded):
    data = ["data=text", f"data.path={corpus_file}"]
    runs = {
        "nproc=1": [],
        "pp=2 ep=2 1f1b": ["parallel.nproc=4", "parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=1f1b"],
        "pp=2 ep=2 interleaved v=2": [
            "parallel.nproc=4", "parallel.pp=2", "parallel.ep=2",
            "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2",
        ],
        "pp=4 gpipe": ["parallel.nproc=4", "parallel.pp=4", "parallel.pp_schedule=gpipe"],
    }  # fmt: skip
    metrics = {}
    for i, (layout, extra) in enumerate(runs.items()):
        run_dir = tmp_path / f"run{i}"
        assert main(["train", *COMMON, *data, *extra, f"run.dir={run_dir}"]) == 0, layout
        metrics[layout] = read_metrics(run_dir)
        info = json.loads((run_dir / "run_info.json").read_text())
        assert info["params"] == json.loads((tmp_path / "run0" / "run_info.json").read_text())["params"]

    reference = metrics.pop("nproc=1")
    assert len({round(m["loss"], 6) for m in reference}) == STEPS  # the loss moves: the comparison means something
    worst = {}
    for layout, run in metrics.items():
        assert [m["step"] for m in run] == list(range(1, STEPS + 1)), layout
        for m, ref in zip(run, reference):
            for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "expert_load_imbalance"):
                assert m[key] == pytest.approx(ref[key], rel=1e-5), f"{layout}: step {m['step']} {key}"
            assert ("val_loss" in m) == ("val_loss" in ref), layout
            if "val_loss" in ref:
                assert m["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6), f"{layout}: val_loss"
        pairs = list(zip(run, reference))
        worst[layout] = {k: max(abs(m[k] - r[k]) / abs(r[k]) for m, r in pairs) for k in ("loss", "grad_norm")}
    print("max relative differences per layout:", worst)
