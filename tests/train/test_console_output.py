"""What a batch job's log gets from `optimus train`: step lines, no progress-bar redraws, no warnings."""

import os
import subprocess
import sys

from tests.conftest import TINY_MODEL


def test_log_file_gets_step_lines_only(corpus_file, tmp_path):
    overrides = [
        *TINY_MODEL,
        "model.dim=32",
        "model.moe.expert_dim=32",
        "kernels=torch",
        "train.seq_len=16",
        "train.global_batch=4",
        "train.micro_batch=4",
        "train.eval_sequences=4",
        "train.steps=2",
        "train.log_interval=1",
        "checkpoint.interval=2",  # a single-process save, which DCP would warn about
        "data=text",
        f"data.path={corpus_file}",
        f"run.dir={tmp_path / 'run'}",
    ]
    # stdout and stderr are pipes here, as in a PBS or SLURM job whose output goes to a file.
    result = subprocess.run(
        [sys.executable, "-m", "optimus", "train", *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ.copy(),
        timeout=600,
    )
    log = result.stdout
    assert result.returncode == 0, log
    assert "\r" not in log, "the progress bar was drawn into a log file"
    assert "it/s" not in log and "s/it" not in log
    step_lines = [line for line in log.splitlines() if line.startswith("step ")]
    assert [line.split("|")[0].split()[1] for line in step_lines] == ["0/2", "1/2", "2/2"]
    assert "warning" not in log.lower(), log
