"""A full disk under the run directory's own files (issue 55, item 9): config.yaml, run_info.json and
metrics.jsonl are each whole or as they were (no cut line, no stray .tmp, no empty config.yaml), and the run ends
with exit code 2 and one sentence naming the disk, what the run kept and the command that goes on from there.
A full checkpoint disk is named as such also when torch's writer hides the ENOSPC ("[enforce fail at
inline_container.cc] unexpected pos", as DCP hands it over from another rank).

The disk fills in two ways: the run's writer is made to write half of a file and then fail with ENOSPC (runs
anywhere), and a small tmpfs is filled for real (where this process may mount one: root)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from optimus.cli import main
from optimus.train import metrics as metrics_module
from optimus.train.checkpoint_dirs import write_failure
from tests.conftest import SMALL_MODEL_RUN
from tests.train.test_run_safety import error_of, steps_of

RUN = [*SMALL_MODEL_RUN, "train.micro_batch=4", "train.eval_sequences=4", "train.eval_interval=100"]


def run_args(corpus_file, run_dir, *extra) -> list[str]:
    return [*RUN, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", *extra]


def files_in(run_dir: Path) -> set[str]:
    return {p.name for p in run_dir.iterdir()}


def fill_up_when_writing(monkeypatch, target: Path, after_records: int = 0) -> None:
    """The run's writer writes half of `target` (or of the temporary file that replaces it), then the disk is
    full; metrics.jsonl fills up after `after_records` records were written whole."""
    real_write_all = metrics_module._write_all
    whole = [0]  # writes of the target that succeeded

    def write_all(fd: int, data: bytes) -> None:
        mine = os.fstat(fd)
        if any(p.exists() and os.path.samestat(mine, os.stat(p)) for p in (target, Path(f"{target}.tmp"))):
            if whole[0] == after_records:
                real_write_all(fd, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            whole[0] += 1
        real_write_all(fd, data)

    monkeypatch.setattr(metrics_module, "_write_all", write_all)


@pytest.mark.parametrize("name", ["config.yaml", "run_info.json"])
def test_a_full_disk_at_the_start_leaves_no_half_written_file(tmp_path, corpus_file, capsys, monkeypatch, name):
    run_dir = tmp_path / "run"
    args = run_args(corpus_file, run_dir, "train.steps=2")
    with monkeypatch.context() as mp:
        fill_up_when_writing(mp, run_dir / name)
        assert main(["train", *args]) == 2
    err = error_of(capsys)
    assert err.splitlines() == [
        f"optimus: error: {run_dir / name} could not be written (no space left on {run_dir}); no record was kept: "
        "free space there and run the same command again."
    ]
    written = {"config.yaml": set(), "run_info.json": {"config.yaml"}}[name]  # what was written before, whole
    assert files_in(run_dir) == {"metrics.jsonl", *written} and (run_dir / "metrics.jsonl").read_text() == ""
    assert main(["train", *args]) == 0  # what the sentence said: the same command
    assert steps_of(run_dir) == [0, 1, 2]


def test_a_full_disk_mid_run_keeps_the_whole_records_and_resumes(tmp_path, corpus_file, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    args = run_args(corpus_file, run_dir, "train.steps=4", "checkpoint.interval=2")
    with monkeypatch.context() as mp:
        fill_up_when_writing(mp, run_dir / "metrics.jsonl", after_records=3)  # steps 0-2 written, step 3 cut
        assert main(["train", *args]) == 2
    err = error_of(capsys)
    checkpoint = run_dir / "checkpoints" / "step_000002"
    assert err.splitlines() == [
        f"optimus: error: {run_dir / 'metrics.jsonl'} could not be written (no space left on {run_dir}); "
        f"metrics.jsonl keeps the records up to step 2, and the latest checkpoint is step_000002 ({checkpoint}): "
        "free space there and run the same command again to resume."
    ]
    assert steps_of(run_dir) == [0, 1, 2]  # no line cut short
    assert main(["train", *args]) == 0
    assert steps_of(run_dir) == [0, 1, 2, 3, 4]


# ---- a real full disk: a small tmpfs --------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs at tmp_path / "disk" (skipped where this process may not mount one), unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def fill(disk: Path, leave_blocks: int) -> None:
    """Fill `disk` up to `leave_blocks` of its blocks (pages, on a tmpfs)."""
    stats = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * ((stats.f_bavail - leave_blocks) * stats.f_frsize))


def test_a_really_full_disk_is_named_and_leaves_no_empty_config(small_disk, corpus_file, capsys):
    """Room for the two claim files (the run and checkpoint directories') and nothing more: config.yaml is the
    first file with content that does not fit (on main: an OSError traceback and an empty config.yaml)."""
    run_dir = small_disk / "run"
    run_dir.mkdir()
    fill(small_disk, leave_blocks=2)
    assert main(["train", *run_args(corpus_file, run_dir, "train.steps=1")]) == 2
    err = error_of(capsys)
    assert err.startswith(f"optimus: error: {run_dir / 'config.yaml'} could not be written (no space left on ")
    assert files_in(run_dir) == {"metrics.jsonl"}  # no config.yaml, empty or whole, no .tmp, no claim left


def test_a_full_checkpoint_disk_is_named_when_torch_hides_the_enospc(small_disk):
    """What DCP hands every rank when another rank's torch.save ran out of space: a RuntimeError that lost the
    OSError it came from (pickled between ranks); on main the sentence named "inline_container.cc" instead."""
    root = small_disk / "checkpoints"
    root.mkdir()
    fill(small_disk, leave_blocks=0)
    hidden = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    cause, remedy = write_failure(CheckpointException("save failed", {1: (hidden, "traceback")}), root)
    assert (cause, remedy) == (f"no space left on {root}", "free space there")
    os.remove(small_disk / "filler")  # the same error with room to spare is not a full disk
    cause, remedy = write_failure(CheckpointException("save failed", {1: (hidden, "traceback")}), root)
    assert cause.startswith("RuntimeError: [enforce fail at inline_container.cc:672]") and remedy.startswith("fix")
