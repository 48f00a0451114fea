"""One run at a time in a run directory and in a checkpoint directory (issue 34): rank 0 claims them before it
writes anything, a second run is refused in one sentence naming the first's host and pid (and when its claim
expires), and the claim ends with the run, not before its last checkpoint write.

Where flock works the claim is an flock on `.optimus-claim`; where it does not (Lustre without the `flock`
mount option) the file's heartbeat decides: a fresh one is kept, a stale one (or, on this host, one whose pid
has ended) is broken. A run whose claim was taken over meanwhile stops at its next step boundary, writing nothing.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest

from optimus.cli import load_config, main
from optimus.config import ConfigError
from optimus.train import run_dir as run_dir_module
from optimus.train.checkpoint import PendingSave
from optimus.train.run_dir import CLAIM_FILE, STALE_AFTER_S, claim_dir, release_claims, remove_if_empty
from optimus.train.trainer import Trainer
from tests.conftest import SMALL_MODEL_RUN
from tests.train.test_run_safety import error_of, steps_of
from tests.unchanged import unchanged

RUN = [
    *SMALL_MODEL_RUN,
    "train.micro_batch=4",
    "train.eval_sequences=8",
    "train.eval_interval=100000",
    "checkpoint.interval=2",
]


def run_overrides(corpus_file, run_dir, *extra) -> list[str]:
    return [*RUN, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", *extra]


@pytest.fixture
def no_flock(monkeypatch):
    """A file system without flock (Lustre mounted without the `flock` option answers ENOSYS, NFS without a
    lock manager ENOLCK)."""

    def flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_dir_module, "flock", flock)


def write_claim(run_dir, host: str, pid: int, age_s: float = 0.0):
    """A claim file as another run would have left it, its heartbeat `age_s` old."""
    run_dir.mkdir(exist_ok=True)
    path = run_dir / CLAIM_FILE
    path.write_text(json.dumps({"host": host, "pid": pid}))
    beat = time.time() - age_s
    os.utime(path, (beat, beat))
    return path


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="pauses the first run with SIGSTOP")
def test_a_second_run_is_refused_while_the_first_runs_and_resumes_after_it(tmp_path, corpus_file, capsys):
    run_dir = tmp_path / "run"
    overrides = run_overrides(corpus_file, run_dir)
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "optimus", "train", *overrides, "train.steps=100000"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    latest = run_dir / "checkpoints" / "latest"
    try:
        deadline = time.monotonic() + 120
        while not latest.exists():
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.1)
        first.send_signal(signal.SIGSTOP)  # its files stand still while the second run tries
        try:
            saved = int(latest.read_text().strip().removeprefix("step_"))
            # Two ranks (the refusal reaches rank 1 as every rank-0 refusal does), and a step count the first
            # run's checkpoint could resume to: without the claim this run would take the directory over.
            with unchanged(run_dir):
                assert main(["train", *overrides, f"train.steps={saved + 1}", "parallel.nproc=2"]) == 2
        finally:
            first.send_signal(signal.SIGCONT)
        err = error_of(capsys)
        assert err.count("\n") == 1 and err.startswith(f"optimus: error: run.dir={run_dir} is in use by another run")
        assert f"(pid {first.pid} on host {socket.gethostname()}, since " in err
        first.send_signal(signal.SIGTERM)  # saves at the next step boundary, ends, and gives the claim up
        assert first.wait(timeout=60) == 0, (tmp_path / "first.log").read_text()
    finally:
        first.kill()
        first.wait()
    assert not (run_dir / CLAIM_FILE).exists()
    last = steps_of(run_dir)[-1]
    assert main(["train", *overrides, f"train.steps={last + 1}"]) == 0  # the same command resumes after it
    assert steps_of(run_dir) == list(range(0, last + 2))
    assert not (run_dir / CLAIM_FILE).exists()


def test_without_flock_a_fresh_claim_of_another_host_refuses_a_run_and_a_stale_one_is_broken(
    no_flock, tmp_path, corpus_file, capsys
):
    run_dir = tmp_path / "run"
    overrides = run_overrides(corpus_file, run_dir, "train.steps=2")
    claim = write_claim(run_dir, "other-node", 4242, age_s=STALE_AFTER_S / 2)
    with unchanged(run_dir):
        assert main(["train", *overrides]) == 2
    # When it expires (its last heartbeat + STALE_AFTER_S): a job requeued on another node knows when to rerun.
    expires = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(claim.stat().st_mtime + STALE_AFTER_S))
    err = error_of(capsys)
    assert err.count("\n") == 1 and "in use by another run (pid 4242 on host other-node), whose claim " in err
    assert f"claim expires at {expires} (in " in err and "run the same command again after that" in err
    write_claim(run_dir, "other-node", 4242, age_s=STALE_AFTER_S + 1)  # its heartbeat stopped
    assert main(["train", *overrides]) == 0
    assert steps_of(run_dir) == [0, 1, 2] and not claim.exists()


@pytest.mark.parametrize("flock", ["works", "missing"])
def test_the_heartbeat_decides_for_a_claim_of_another_host(request, tmp_path, flock):
    """With flock too: on Lustre's `localflock` mounts a lock holds on its own node only."""
    if flock == "missing":
        request.getfixturevalue("no_flock")
    claim = write_claim(tmp_path, "other-node", 4242, age_s=STALE_AFTER_S - 5)
    with unchanged(tmp_path):
        busy = claim_dir(tmp_path)
    assert isinstance(busy, ConfigError) and "(pid 4242 on host other-node)" in str(busy)
    write_claim(tmp_path, "other-node", 4242, age_s=STALE_AFTER_S + 5)
    try:
        assert claim_dir(tmp_path) is None
        assert json.loads(claim.read_text())["pid"] == os.getpid()
    finally:
        release_claims()
    assert not claim.exists()


def test_without_flock_a_claim_of_this_host_holds_while_its_pid_lives(no_flock, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        write_claim(tmp_path, socket.gethostname(), holder.pid)
        busy = claim_dir(tmp_path)
        assert isinstance(busy, ConfigError) and f"(pid {holder.pid} on host {socket.gethostname()})" in str(busy)
    finally:
        holder.kill()
        holder.wait()
    try:
        assert claim_dir(tmp_path) is None  # its pid has ended: broken although the heartbeat is fresh
    finally:
        release_claims()


def test_without_flock_the_holder_keeps_its_heartbeat_fresh(no_flock, tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir_module, "HEARTBEAT_S", 0.05)
    claim = tmp_path / CLAIM_FILE
    try:
        assert claim_dir(tmp_path) is None
        os.utime(claim, (0, 0))  # as old as it gets
        deadline = time.monotonic() + 30
        while claim.stat().st_mtime == 0:
            assert time.monotonic() < deadline, "the heartbeat never touched the claim file"
            time.sleep(0.05)
    finally:
        release_claims()
    assert not claim.exists()


def test_a_run_is_refused_a_checkpoint_dir_that_a_run_in_another_run_dir_holds(tmp_path, corpus_file):
    checkpoints = tmp_path / "shared-checkpoints"
    first = Trainer.from_config(
        load_config(run_overrides(corpus_file, tmp_path / "first", f"checkpoint.dir={checkpoints}"))
    )
    try:
        second = run_overrides(corpus_file, tmp_path / "second", f"checkpoint.dir={checkpoints}", "train.steps=2")
        with unchanged(tmp_path):  # the second run's directory is not left behind either
            refused = subprocess.run(
                [sys.executable, "-m", "optimus", "train", *second],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
    finally:
        remove_if_empty()
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith(
        f"optimus: error: checkpoint.dir={checkpoints} is in use by another run (pid {os.getpid()} on host "
    )
    assert first.checkpointer.root == checkpoints and not (checkpoints / CLAIM_FILE).exists()  # released


def replace_claim(path, how: str) -> None:
    """Another run takes the claim over: without flock it removes the stale file and creates its own, with flock
    (on another node of a `localflock` mount) it rewrites the record of the same file."""
    record = json.dumps({"host": "other-node", "pid": 4242})
    if how == "replaced":
        staged = path.with_name("staged")
        staged.write_text(record)
        os.replace(staged, path)
    else:
        with open(path, "r+") as file:
            file.write(record)
            file.truncate()


@pytest.mark.parametrize("how", ["replaced", "rewritten"])
def test_a_run_whose_claim_was_taken_over_stops_at_the_next_step_without_writing(
    how, tmp_path, corpus_file, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    train_step = Trainer.train_step

    def taken_over_during_step_2(trainer):
        if trainer.step == 1:  # as if this run had been paused past STALE_AFTER_S and a successor had started
            replace_claim(run_dir / CLAIM_FILE, how)
        return train_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", taken_over_during_step_2)
    assert main(["train", *run_overrides(corpus_file, run_dir, "train.steps=4")]) == 2  # checkpoint.interval=2
    err = error_of(capsys)
    assert err.count("\n") == 1
    assert f"run.dir={run_dir} was taken over by another run (pid 4242 on host other-node) after " in err
    assert steps_of(run_dir) == [0, 1]  # no record of step 2, and no checkpoint of it
    assert not list((run_dir / "checkpoints").glob("step_*")) and not (run_dir / "checkpoints" / "latest").exists()
    assert json.loads((run_dir / CLAIM_FILE).read_text())["pid"] == 4242  # the successor's claim stays


def test_the_heartbeat_stops_on_a_claim_taken_over(tmp_path, monkeypatch):
    """Beating on would renew the successor's claim (rewritten in place, it is the same file)."""
    monkeypatch.setattr(run_dir_module, "HEARTBEAT_S", 0.05)
    claim_file = tmp_path / CLAIM_FILE
    try:
        assert claim_dir(tmp_path) is None
        claim = run_dir_module._claims[tmp_path.resolve()]
        replace_claim(claim_file, "rewritten")
        os.utime(claim_file, (0, 0))
        claim._beat.join(timeout=30)
        assert not claim._beat.is_alive() and claim_file.stat().st_mtime == 0
        assert "was taken over by another run (pid 4242 on host other-node)" in run_dir_module.lost_claim()
    finally:
        release_claims()
    assert claim_file.exists()  # the successor's, not removed by this process's release


def test_the_claim_outlives_a_background_save_when_fit_ends_by_an_exception(tmp_path, corpus_file, monkeypatch):
    run_dir = tmp_path / "run"
    trainer = Trainer.from_config(load_config(run_overrides(corpus_file, run_dir, "checkpoint.async_save=true")))
    claim = run_dir / CLAIM_FILE
    writing = Future()  # a background save still writing when the run fails
    trainer.checkpointer.pending = PendingSave(2, run_dir / "checkpoints" / "step_000002.tmp", writing, 0.0, 0.0)
    held_while_writing = []

    def finish_writing():
        deadline = time.monotonic() + 2  # the run releases its claim at once, or waits for this save
        while claim.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        held_while_writing.append(claim.exists())
        writing.set_exception(OSError(errno.ENOSPC, "No space left on device"))

    save_thread = threading.Thread(target=finish_writing, daemon=True)

    def failing_step():
        save_thread.start()
        raise RuntimeError("a rank failed")

    monkeypatch.setattr(trainer, "_traced_step", failing_step)
    try:
        with pytest.raises(RuntimeError, match="a rank failed"):  # not the save's error
            trainer.fit()
    finally:
        remove_if_empty()
    save_thread.join()
    assert held_while_writing == [True] and not claim.exists()


# ---- claim files that are not what a run writes (issue 55) -------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_claim_file_that_is_not_a_regular_file_is_refused_and_left_alone(tmp_path, corpus_file, capsys, kind):
    """A link is never written through (its target would be replaced by a claim record, then the link removed),
    however old its target is; nor is a directory taken for a claim."""
    run_dir, mine = tmp_path / "run", tmp_path / "mine.txt"
    run_dir.mkdir()
    mine.write_text("the user's own\n")
    os.utime(mine, (0, 0))  # as stale as a claim gets: on main it was taken over, through the link
    if kind == "symlink":
        (run_dir / CLAIM_FILE).symlink_to(mine)
    else:
        (run_dir / CLAIM_FILE).mkdir()
    with unchanged(tmp_path):
        assert main(["train", *run_overrides(corpus_file, run_dir, "train.steps=1")]) == 2
    err = error_of(capsys)
    what = "a symbolic link" if kind == "symlink" else "a directory"
    assert err.count("\n") == 1 and f"run.dir={run_dir} holds {CLAIM_FILE}, which is {what}, not the claim " in err
    assert (run_dir / CLAIM_FILE).is_symlink() == (kind == "symlink")


@pytest.mark.parametrize("content", ["", "not json"])
def test_a_claim_file_naming_no_holder_is_taken_over_when_its_flock_is_free(tmp_path, content):
    """Empty or garbage, and fresh: no run holds it (a live one would hold its flock, and its record names it).
    Without flock only its heartbeat can tell, so it is held until it is stale."""
    claim = tmp_path / CLAIM_FILE
    claim.write_text(content)
    try:
        assert claim_dir(tmp_path) is None
        assert json.loads(claim.read_text())["pid"] == os.getpid()
    finally:
        release_claims()
    assert not claim.exists()


def test_without_flock_a_fresh_claim_file_naming_no_holder_waits_for_its_heartbeat(no_flock, tmp_path):
    claim = tmp_path / CLAIM_FILE
    claim.write_text("not json")
    with unchanged(tmp_path):
        busy = claim_dir(tmp_path)
    assert isinstance(busy, ConfigError) and "another run that has not recorded its host and pid yet" in str(busy)
