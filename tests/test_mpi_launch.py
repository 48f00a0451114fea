"""A real MPI launcher: `mpiexec -n 2 optimus train ... parallel.ep=2`, ranks found through PMI variables."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.conftest import TINY_MODEL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not installed (.ci/run installs Debian's mpich)")
def test_mpiexec_trains_with_expert_parallelism(tmp_path, corpus_file):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    command = [
        "mpiexec", "-n", "2", sys.executable, "-m", "optimus", "train", *TINY_MODEL,
        "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", "parallel.ep=2",
        "train.steps=3", "train.seq_len=32", "train.global_batch=8", "train.micro_batch=4",
        "train.eval_sequences=8", "logging.progress=false", "parallel.timeout_s=120",
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["layout"]["world"] == 2 and info["layout"]["ep"] == 2
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]  # 0: the starting evaluation
