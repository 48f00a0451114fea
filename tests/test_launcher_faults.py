"""Faults around the local launcher (`parallel.nproc=N`, optimus.local_launcher.spawn_local), issue 34: ranks end with
their launcher, a rank that dies is named with the signal that ended it, and stop signals that reach the ranks
before they can save end in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from optimus.local_launcher import SpawnError, SpawnStopped, report_saved_at_stop, spawn_local
from optimus.ranks import discover, init_process_group
from tests.train.test_faults import COMMON, _alive, _descendants

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process tree from /proc")


def _signal_self_once(path: Path, sig: signal.Signals, times: int = 1) -> threading.Thread:
    """A thread that sends `sig` to this process (the launcher) once `path` exists, `times` times, each after
    the rank has written `path` again with one more line (it got the one before)."""

    def send():
        for sent in range(times):
            deadline = time.monotonic() + 60
            while not (path.exists() and len(path.read_text().splitlines()) > sent):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
            os.kill(os.getpid(), sig)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def _start_slowly() -> None:
    """A rank still starting (importing, building its model): no stop-signal handler yet."""
    Path(os.environ["OPTIMUS_TEST_READY"]).write_text("started\n")
    time.sleep(60)


def test_an_early_stop_signal_ends_in_one_line(tmp_path, monkeypatch):
    ready = tmp_path / "ready"
    monkeypatch.setenv("OPTIMUS_TEST_READY", str(ready))
    sender = _signal_self_once(ready, signal.SIGTERM)
    try:
        with pytest.raises(SpawnStopped) as stopped:
            spawn_local(1, _start_slowly)
    finally:
        sender.join()
    assert str(stopped.value) == "stopped by SIGTERM before the ranks had started training"
    assert stopped.value.exit_code == 128 + signal.SIGTERM


def _ignore_stop_requests() -> None:
    """A rank that takes every Ctrl-C as a request to stop at the next step boundary, and never gets there."""
    ready = Path(os.environ["OPTIMUS_TEST_READY"])

    def note(signum, frame):
        with open(ready, "a") as f:
            f.write(f"{signal.Signals(signum).name}\n")

    signal.signal(signal.SIGINT, note)
    ready.write_text("started\n")
    time.sleep(60)


def test_a_second_ctrl_c_ends_in_one_line(tmp_path, monkeypatch):
    ready = tmp_path / "ready"
    monkeypatch.setenv("OPTIMUS_TEST_READY", str(ready))
    sender = _signal_self_once(ready, signal.SIGINT, times=2)
    try:
        with pytest.raises(SpawnStopped) as stopped:
            spawn_local(1, _ignore_stop_requests)
    finally:
        sender.join()
    assert ready.read_text().splitlines() == ["started", "SIGINT"]  # the first reached the rank; the second ended it
    assert str(stopped.value) == "stopped by a second SIGINT before the ranks had saved"
    assert stopped.value.exit_code == 128 + signal.SIGINT


def _saved_then_slow_to_end() -> None:
    """A rank that saves at a Ctrl-C and says so (as the trainer does), then takes its time to end."""
    ready = Path(os.environ["OPTIMUS_TEST_READY"])

    def save(signum, frame):
        report_saved_at_stop()
        with open(ready, "a") as f:
            f.write(f"{signal.Signals(signum).name}\n")

    signal.signal(signal.SIGINT, save)
    ready.write_text("started\n")
    time.sleep(60)


def test_a_second_ctrl_c_after_the_ranks_saved_ends_a_run_that_saved(tmp_path, monkeypatch):
    """The second Ctrl-C still ends the ranks at once; they had saved and said so: no second line, exit 0."""
    ready = tmp_path / "ready"
    monkeypatch.setenv("OPTIMUS_TEST_READY", str(ready))
    sender = _signal_self_once(ready, signal.SIGINT, times=2)
    started = time.monotonic()
    try:
        with pytest.raises(SpawnStopped) as stopped:
            spawn_local(1, _saved_then_slow_to_end)
    finally:
        sender.join()
    assert time.monotonic() - started < 50  # ended, not waited for
    assert stopped.value.saved and stopped.value.exit_code == 0


def _die_on_rank_one() -> int:
    """Rank 1 is killed (kill -9, the OOM killer) while rank 0 waits for it in a collective."""
    info = discover()
    init_process_group(info, "gloo", torch.device("cpu"), timeout_s=60)
    dist.barrier()
    if info.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0: "Connection closed by peer", which is not what the user needs to read
    return 0


def test_a_killed_rank_is_named_with_its_signal_not_the_survivors_error():
    with pytest.raises(SpawnError) as failed:
        spawn_local(2, _die_on_rank_one)
    message = str(failed.value)
    assert message.startswith("local rank 1 (pid ") and "was killed by SIGKILL" in message
    assert "\n" not in message and "rank 0" not in message and "Connection" not in message


def test_killing_the_launcher_ends_its_ranks_after_they_saved(tmp_path, corpus_file):
    """kill -9 of `optimus train parallel.nproc=2`: the ranks notice, save at the next step boundary and end."""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    overrides = [*COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", "parallel.nproc=2"]
    with open(tmp_path / "launcher.log", "w") as log:  # not a pipe: nobody reads it once the launcher is gone
        launcher = subprocess.Popen(
            [sys.executable, "-m", "optimus", "train", *overrides, "train.steps=100000"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)},
            start_new_session=True,  # its own process group, so the test can clean up whatever is left
        )
    try:
        deadline = time.monotonic() + 180
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.log").read_text()
            time.sleep(0.1)
        ranks = _descendants(launcher.pid)
        assert len(ranks) >= 2
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in ranks if _alive(pid)]
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # the ranks are in the launcher's group
    assert not left, f"processes {left} still ran 30 s after their launcher was killed"
    assert (run_dir / "checkpoints" / "latest").exists(), (tmp_path / "launcher.log").read_text()
    assert not list(tmp.glob("optimus-spawn-*"))  # the ranks removed what the launcher would have removed


WATCHED_RANK = """
import os, signal, sys, time
import optimus.local_launcher as local_launcher

local_launcher.LAUNCHER_POLL_S, local_launcher.ORPHAN_EXIT_S = 0.05, 1.0
signal.signal(signal.SIGTERM, lambda signum, frame: open(sys.argv[1], "w").write("asked to stop"))
local_launcher._LauncherWatch(os.getppid()).start()
open(sys.argv[1] + ".ready", "w").close()
time.sleep(120)  # stuck (in a collective, say): it does not stop by itself
"""

LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(120)
"""


def test_a_stuck_rank_still_ends_with_its_launcher(tmp_path):
    """The poll of the launcher's pid asks the rank to stop, and ends it when it does not (it is stuck)."""
    asked = tmp_path / "asked"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WATCHED_RANK, str(asked)], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{asked}.ready").exists():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        (rank,) = _descendants(launcher.pid)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = _alive(rank)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
    assert asked.read_text() == "asked to stop"
    assert not alive
