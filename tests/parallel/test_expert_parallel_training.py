"""Layout invariance through the real CLI: expert-parallel runs reproduce the single-process trajectory.

ARCHITECTURE.md's oracle: in fp32, any layout gives the same per-step loss and
gradient norm as one process accumulating over the same micro-batches (relative
1e-5). The EP runs go through `optimus train parallel.nproc=4 ...` (torch's
elastic launcher) and `torchrun -m optimus train` (joining a launched job).
The sigmoid router is used so the aux-loss-free bias update, which depends on
expert loads summed over the world, is part of what must agree.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import TINY_MODEL
from tests.trajectories import assert_same_trajectory as assert_follows
from tests.trajectories import read_metrics, train_layouts

STEPS = 5
COMMON = [
    *TINY_MODEL,
    "model.dim=32",
    "model.moe.expert_dim=32",
    "model.moe.router=sigmoid",
    "model.moe.n_shared_experts=1",
    "model.moe.bias_update_rate=0.01",
    "train.dtype=fp32",
    "kernels=torch",
    "logging.progress=false",
    f"train.steps={STEPS}",
    "train.seq_len=16",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.eval_sequences=6",  # not a multiple of 4 ranks x 2: some ranks evaluate padding only
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    "parallel.timeout_s=60",
]


def assert_same_trajectory(metrics: list[dict], reference: list[dict], layout: str) -> dict:
    """The starting evaluation and every step, compared as tests.trajectories does; returns its differences."""
    assert [m["step"] for m in metrics] == list(range(0, STEPS + 1)), layout
    return assert_follows(metrics, reference, layout)


@pytest.mark.slow
def test_ep_layouts_match_single_process(tmp_path, corpus_file, single_threaded):
    data = ["data=text", f"data.path={corpus_file}"]
    runs = {
        "nproc=1": [],
        "nproc=4 ep=2 alltoall": ["parallel.nproc=4", "parallel.ep=2"],
        "nproc=4 ep=4 allgather": [
            "parallel.nproc=4", "parallel.ep=4", "parallel.dispatcher=allgather", "optim.overlap_param_gather=true",
        ],
        # hierarchical sharding: the dense state in 2 shard groups of 2, reduced bucket by bucket in the backward
        "nproc=4 ep=2 shard_ranks=2": [
            "parallel.nproc=4", "parallel.ep=2", "optim.shard_ranks=2", "optim.zero=2", "optim.bucket_mb=0.01",
        ],
    }  # fmt: skip
    metrics, infos = train_layouts(tmp_path, runs, [*COMMON, *data])
    for layout, extra in runs.items():
        world = 4 if extra else 1
        ep = {"nproc=1": 1, "nproc=4 ep=2 alltoall": 2, "nproc=4 ep=4 allgather": 4, "nproc=4 ep=2 shard_ranks=2": 2}
        ep = ep[layout]
        expected = {
            "world": world,
            "pp": 1,
            "dp": world,
            "tp": 1,
            "ep": ep,
            "edp": world // ep,
            "accum": 4 // world,
            "shard_ranks": 2 if "shard_ranks" in layout else None,
        }
        assert infos[layout]["layout"] == expected, layout

    reference = metrics["nproc=1"]
    assert len({round(m["loss"], 6) for m in reference[1:]}) == STEPS  # the loss moves: the comparison means something
    worst = {layout: assert_same_trajectory(m, reference, layout) for layout, m in metrics.items()}
    print("max relative differences per layout, and where routing first differs:", worst)

    # The same run joined from torchrun (2 ranks, EP = 2, accumulation over 2 micro-batches).
    run_dir = tmp_path / "torchrun"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "optimus", "train", *COMMON, *data, "parallel.ep=2", "parallel.dispatcher=allgather",
        f"run.dir={run_dir}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Finished {STEPS} steps" in proc.stdout
    assert_same_trajectory(read_metrics(run_dir), reference, "torchrun 2 ranks ep=2 allgather")
