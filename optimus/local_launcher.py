"""The local launcher: the ranks that `parallel.nproc=N` starts on this machine, outside any launcher.

`spawn_local()` starts N processes with PyTorch's elastic process starter, the same machinery as
torchrun, passes stop signals on to them, names a rank that dies, and its ranks end with it.
Kept apart from rank discovery (optimus.ranks), which the ranks of every launcher need: this is
the one launcher Optimus is itself, with the processes, signals and failures that come with it.
The ranks it starts are handed torchrun's environment, so `discover()` finds them as torchrun's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimus.config import ConfigError
from optimus.kernels.torch_private import process_context_processes
from optimus.processes import ProcessEnd, quiet_resource_tracker, start_forkserver


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_errors(log_dir: Path, ranks: set[int]) -> list[str]:
    """These failed ranks' own exception text and traceback, from the error files `record` wrote."""
    lines = []
    for path in sorted(log_dir.rglob("error.json"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0):
        if not path.parent.name.isdigit() or int(path.parent.name) not in ranks:
            continue
        try:
            entry = json.loads(path.read_text())["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        text = entry.get("message", "") if isinstance(entry, dict) else str(entry)
        stack = entry.get("extraInfo", {}).get("py_callstack", "") if isinstance(entry, dict) else ""
        lines.append(f"rank {path.parent.name}: {text}" + (f"\n{stack.rstrip()}" if stack else ""))
    return lines


class SpawnError(RuntimeError):
    """A locally spawned rank failed; the message names it and carries its exception or the signal that ended it."""


class SpawnStopped(RuntimeError):
    """A stop signal ended the ranks (ranks that end by themselves after saving return as usual, their result
    saying so): before they could save, with `exit_code` 128 + the signal's number; or, a second Ctrl-C,
    after they had saved at a step boundary and said so (`saved`; exit code 0 as for a stop that saved)."""

    def __init__(self, message: str, exit_code: int, saved: bool = False):
        super().__init__(message)
        self.exit_code, self.saved = exit_code, saved


class RankRefused(ConfigError):
    """A spawned rank met a user error (bad config, data, layout); the message is its one sentence."""


_SPAWN_DIR = "OPTIMUS_SPAWN_DIR"  # where a rank of spawn_local leaves the sentence of a user error


_SAVED_AT_STOP = "saved-at-stop"  # in the spawn dir: the ranks saved at a stop signal, and said so


def report_saved_at_stop() -> None:
    """In a rank that spawn_local started (else nothing): the run saved at a stop signal and said so. A second
    Ctrl-C that ends the ranks from now on (in their teardown) ends a run that saved: the launcher adds no
    line to the one that said it."""
    directory = os.environ.get(_SPAWN_DIR)
    if directory:
        Path(directory, _SAVED_AT_STOP).touch(exist_ok=True)


def report_user_error(message: str) -> bool:
    """In a rank that spawn_local started: hand a user error's sentence to the parent, which says it once
    (instead of every rank printing a traceback). False outside spawn_local."""
    directory = os.environ.get(_SPAWN_DIR)
    if not directory:
        return False
    Path(directory, f"user-error-{os.environ.get('RANK', '0')}.txt").write_text(message)
    return True


# ---------------------------------------------------------------------------------------------
# Inside a spawned rank: end with the launcher. When `optimus train` is killed (kill -9, an OOM kill, a closed
# session), nothing would stop its ranks: they would train on, and after their last step wait forever for the
# launcher to collect their result.

LAUNCHER_POLL_S = 1.0  # how often a rank looks for its launcher where there is no pidfd
ORPHAN_EXIT_S = 20.0  # after the launcher has gone: time to save at a step boundary before the rank ends anyway


class _LauncherWatch:
    """Notices that the launcher has gone, asks the rank to stop as SIGTERM does (it saves at the next step
    boundary: optimus.train.faults), and ends the process if that has not happened within ORPHAN_EXIT_S.

    The launcher is not the rank's parent (the ranks are forked from a forkserver, which outlives the launcher
    until they end), so neither the parent pid nor Linux's parent-death signal would tell: the watch follows the
    launcher's own process (optimus.processes.ProcessEnd)."""

    def __init__(self, launcher_pid: int):
        self.launcher = ProcessEnd(launcher_pid, poll_s=LAUNCHER_POLL_S)

    def start(self) -> None:
        threading.Thread(target=self._watch, name="optimus-launcher-watch", daemon=True).start()

    def _watch(self) -> None:
        self.launcher.wait()
        _remove_spawn_dir()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_EXIT_S)
        self.exit(1)  # stuck (in a collective with a rank that has ended): no one will come for it

    def launcher_gone(self) -> bool:
        return self.launcher.has_ended()

    @staticmethod
    def exit(code: int) -> None:
        """End now: nobody reads the result, and torch's starter would wait forever for the launcher to."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        _remove_spawn_dir()
        os._exit(code)


def _remove_spawn_dir() -> None:
    """The launcher has gone: nobody reads the ranks' error files now, nor removes them."""
    shutil.rmtree(os.environ.get(_SPAWN_DIR, ""), ignore_errors=True)


def _end_at_start_up(signum, frame) -> None:
    """Ctrl-C before the rank can stop at a step boundary (the trainer's handler replaces this one): end now,
    without a traceback, as SIGTERM would; the launcher says it in one line."""
    raise SystemExit(128 + signum)


@dataclass(frozen=True)
class _Launch:
    """What a rank takes from its launcher at the launch, which a rank forked from the forkserver would otherwise
    have from the server's start: the environment, the working directory, and the launcher's pid (for its
    standard output and error, and the watch)."""

    environ: dict[str, str]  # the launcher's, with the rank's torchrun variables
    cwd: str
    launcher_pid: int


def _take_the_launch(launch: _Launch) -> None:
    """The launcher's environment (torch's starter has set every variable of it; what the launcher has unset
    since the server started goes, but the starter's own), working directory, intra-op threads, and output."""
    for key in set(os.environ) - set(launch.environ):
        if not key.startswith("TORCHELASTIC_"):  # the starter's own: the file for this rank's error
            del os.environ[key]
    os.chdir(launch.cwd)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # the OpenMP runtime read the server's value when torch loaded
        import torch

        torch.set_num_threads(int(threads))
    _write_where_the_launcher_writes(launch.launcher_pid)


def _write_where_the_launcher_writes(launcher_pid: int) -> None:
    """The server's standard output and error are the launcher's when the server started. Where the launcher
    has pointed its own elsewhere since (pytest's capture, test by test), the rank writes where they point now:
    the same file opened again, appending. Otherwise (a launcher's first launch, a terminal, a job's log)
    nothing changes: the rank shares the launcher's own open files, their offsets included."""
    for fd in (1, 2):
        theirs = f"/proc/{launcher_pid}/fd/{fd}"
        try:
            ours, now = os.fstat(fd), os.stat(theirs)
        except OSError:
            continue  # no /proc, or either is closed: leave it
        if (ours.st_dev, ours.st_ino) == (now.st_dev, now.st_ino):
            continue
        try:
            reopened = os.open(theirs, os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        (sys.stdout if fd == 1 else sys.stderr).flush()
        os.dup2(reopened, fd)
        os.close(reopened)


def _rank_main(launch: _Launch, entrypoint: Callable, *args) -> Any:
    """What spawn_local runs in each rank: `entrypoint(*args)`, in the launch's environment, ending with the
    launcher."""
    signal.signal(signal.SIGINT, _end_at_start_up)
    # The server (started by _start_ranks with SIGINT blocked) forked this process with SIGINT blocked, so that
    # a Ctrl-C (which reaches every process of the terminal's group) until here waited instead of raising a
    # KeyboardInterrupt in the server's imports or the rank's: a pending one takes effect now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    watch = _LauncherWatch(launch.launcher_pid)
    watch.start()
    _take_the_launch(launch)
    result = entrypoint(*args)
    if watch.launcher_gone():
        watch.exit(0)
    return result


# ---------------------------------------------------------------------------------------------
# In the launcher

# Signals the parent passes on to the ranks, which stop at a step boundary and save (optimus.train.faults):
# SIGTERM/SIGUSR1 from PBS/SLURM before a kill, SIGINT from Ctrl-C (a terminal also sends it to the ranks).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
FAILURE_GRACE_S = 2.0  # after one rank failed, how long the others get to end by themselves


class _Forwarder:
    """While installed, each forwarded signal is passed on to the ranks; a second Ctrl-C ends them at once.
    Installed before the ranks are started: what comes meanwhile is passed on once they are (`started`)."""

    def __init__(self):
        self.pids: list[int] | None = None
        self.received, self.sent, self._previous, self._pending = [], set(), {}, []
        self.kill_requested = False  # a second Ctrl-C once the ranks run: `kill_if_requested` ends them

    def install(self) -> None:
        """Pass the stop signals on from now; called again after torch's process starter, where it put its own
        handlers over these (the first ones are what `restore` puts back)."""
        for sig in FORWARDED_SIGNALS:
            self._previous.setdefault(sig, signal.signal(sig, self._handle))

    def restore(self) -> None:
        while self._previous:
            sig, handler = self._previous.popitem()
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python

    def started(self, pids: list[int]) -> None:
        self.pids = pids
        for sig in self._pending:
            self.send(sig)

    def _handle(self, signum, frame) -> None:
        sig = signal.Signals(signum)
        again = sig == signal.SIGINT and sig.name in self.received
        self.received.append(sig.name)
        if again and self.pids is not None:
            # Killed from the launcher's poll loop, not here: this handler can run inside torch's poll while it
            # wakes the ranks that have returned (worker_finished_event.set), and a rank killed as it is woken
            # leaves that call waiting for it forever.
            self.kill_requested = True
        else:
            self.send(signal.SIGKILL if again else sig)

    def kill_if_requested(self, processes: list) -> None:
        """After a second Ctrl-C: SIGKILL every rank, and wait until each has ended, so that torch's poll that
        follows finds them dead rather than waking them."""
        if not self.kill_requested:
            return
        self.kill_requested = False
        self.send(signal.SIGKILL)
        for process in processes:
            process.join()

    def send(self, sig: signal.Signals) -> None:
        self.sent.add(int(sig))
        if self.pids is None:
            self._pending.append(sig)
            return
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # that rank has already ended


def _failed_ranks(processes: list) -> dict[int, int]:
    """{rank: exit code} of the rank `processes` (torch's process context keeps them: only they can tell each
    one's exit code) that have ended with a failure (negative: the signal that ended them)."""
    codes = {rank: process.exitcode for rank, process in enumerate(processes)}
    return {rank: code for rank, code in codes.items() if code not in (None, 0)}


def _wait(ranks: Any, log_dir: Path, forwarder: _Forwarder) -> tuple[Any, dict[int, int]]:
    """Poll until every rank ended; returns torch's result and the first ranks seen failing, with their exit
    codes (the others mostly fail because of them). Once one has failed, the others are stuck in a collective:
    after a short grace they are killed, rather than waited for until a timeout."""
    failed_at, first_failed = None, {}
    processes = process_context_processes(ranks)
    while True:
        forwarder.kill_if_requested(processes)
        first_failed = first_failed or _failed_ranks(processes)  # before torch's poll reaps the rest
        if (result := ranks.wait(timeout=0)) is not None:
            break
        if failed_at is None and (any(log_dir.glob("user-error-*")) or any(log_dir.rglob("error.json"))):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
            forwarder.send(signal.SIGKILL)
        time.sleep(0.05)
    return result, first_failed or {rank: failure.exitcode for rank, failure in result.failures.items()}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _failure_message(first_failed: dict[int, int], pids: dict[int, int], log_dir: Path, sent: set[int]) -> str:
    """The rank(s) that failed first and why: a signal from outside that ended them (the others then lost their
    peer, which is not worth reporting), else their own exceptions."""
    killed = {rank: -code for rank, code in first_failed.items() if code < 0 and -code not in sent}
    if killed:
        deaths = [
            f"local rank {rank} (pid {pids[rank]}) was killed by {_signal_name(number)}"
            + (
                " (from outside the run: kill -9, or the kernel's out-of-memory killer)"
                if number == signal.SIGKILL
                else ""
            )
            for rank, number in sorted(killed.items())
        ]
        return "; ".join(deaths) + "; the other ranks were stopped."
    errors = _child_errors(log_dir, set(first_failed))
    if errors:
        return "a local rank failed:\n" + "\n".join(errors)
    exits = [f"local rank {rank} (pid {pids[rank]}) exited with code {code}" for rank, code in first_failed.items()]
    return "; ".join(exits) + " without an error message; the other ranks were stopped."


def _ended_by(code: int, sent: set[int]) -> int | None:
    """The signal among `sent` that ended a rank with exit code `code`: killed by it (-signal), or ended by
    itself at start-up on it (128 + signal: `_end_at_start_up`)."""
    for number in (-code, code - 128):
        if number in sent:
            return number
    return None


def _stopped(forwarder: _Forwarder, first_failed: dict[int, int], log_dir: Path) -> SpawnStopped | None:
    """The ranks ended because of a stop signal passed on (or a second Ctrl-C's SIGKILL), before they could
    save or after they had (report_saved_at_stop)."""
    by_launcher = [number for code in first_failed.values() if (number := _ended_by(code, forwarder.sent))]
    if not forwarder.received or not by_launcher:
        return None
    if (log_dir / _SAVED_AT_STOP).exists():
        return SpawnStopped(f"stopped by a second {forwarder.received[-1]} after the ranks had saved", 0, saved=True)
    if by_launcher[0] == signal.SIGKILL:  # sent only on a second Ctrl-C
        return SpawnStopped("stopped by a second SIGINT before the ranks had saved", 128 + signal.SIGINT)
    first = forwarder.received[0]
    return SpawnStopped(f"stopped by {first} before the ranks had started training", 128 + by_launcher[0])


def spawn_local(nproc: int, entrypoint: Callable, args: tuple = (), run_id: str | None = None) -> dict[int, Any]:
    """Run `entrypoint(*args)` in `nproc` fresh processes; returns {rank: value}.

    `entrypoint` must be importable by name (a module-level function): the ranks are forked from
    multiprocessing's forkserver (see _start_ranks), not from this process. Each sees this process's
    environment, working directory and output, with torchrun's variables added (RANK, WORLD_SIZE,
    MASTER_ADDR, ...), so `discover()` works inside it. Unlike torchrun's agent, which kills the ranks 30 s after a
    SIGTERM, this parent passes SIGTERM, SIGINT and SIGUSR1 on and waits for the ranks to save
    and return (their values say that they stopped); a stop signal that ends them before they could
    save ends in SpawnStopped. A rank's user error (report_user_error) ends in RankRefused, any other
    failure in SpawnError naming the rank that failed first and why.
    The ranks end within ORPHAN_EXIT_S (saving if they can) if this process dies. Nothing is left
    behind in /tmp.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be at least 1.")
    log_dir = Path(tempfile.mkdtemp(prefix="optimus-spawn-"))  # error files; removed at the end
    port = str(_free_port())
    envs = {
        rank: {
            **os.environ,
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, _SPAWN_DIR: str(log_dir),
            "TORCHELASTIC_RUN_ID": run_id or f"optimus-{os.getpid()}",
        }
        for rank in range(nproc)
    }  # fmt: skip
    # The starter logs every failed rank with the parent's own traceback, and each rank it ends; the ranks'
    # errors are reported below.
    quiet = [
        logging.getLogger(name)
        for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    ]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    forwarder = _Forwarder()
    try:
        quiet_resource_tracker()
        forwarder.install()  # replaces the handlers of whoever called (they would raise, leaving the ranks)
        ranks = _start_ranks(nproc, entrypoint, args, envs, log_dir)
        pids = ranks.pids()
        forwarder.install()  # where torch's starter put its own handlers in place (they would kill the ranks)
        forwarder.started(list(pids.values()))
        try:
            result, first_failed = _wait(ranks, log_dir, forwarder)
        except SignalException as err:  # SIGHUP or SIGQUIT: the session is going away
            ranks.close(err.sigval, timeout=10)
            raise SpawnStopped(f"stopped by {err.sigval.name}", 128 + err.sigval) from None
        finally:
            forwarder.restore()
            ranks.close(signal.SIGKILL)
        refusals = sorted(log_dir.glob("user-error-*.txt"))
        if refusals:
            raise RankRefused(refusals[0].read_text())
        if result.is_failed():
            raise _stopped(forwarder, first_failed, log_dir) or SpawnError(
                _failure_message(first_failed, pids, log_dir, forwarder.sent)
            )
        return result.return_values
    finally:
        forwarder.restore()  # if the ranks could not be started
        for log, level in zip(quiet, levels):
            log.setLevel(level)
        shutil.rmtree(log_dir, ignore_errors=True)


_TORCH_SIGNALS = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # the signals torch's starter turns into SignalException


# What multiprocessing's forkserver imports once, as it starts: everything a rank of `optimus train` imports (about
# 10 s of CPU on a slow core), which each rank forked from it then has loaded.
RANK_MODULES = ("optimus.train.rank",)


def _start_ranks(nproc: int, entrypoint: Callable, args: tuple, envs: dict, log_dir: Path) -> Any:
    """torch's elastic process starter, whose ranks are forked from multiprocessing's forkserver (spawned where
    the platform has none). The server (one per launching process, which its measuring processes share:
    optimus.processes.start_forkserver) imports RANK_MODULES once where this launch starts it, so N ranks cost
    one import of torch and the trainer instead of N, each on its share of the cores; the ranks of later
    launches from the same process (a script's, the tests') start at once. A rank forked from it has the
    server's environment, directory and output: `_rank_main` takes the launch's (`_Launch`).

    SIGINT is blocked while the server starts and the ranks are forked (they inherit the server's mask): a
    Ctrl-C (which reaches every process of the terminal's group) then waits, in a rank until _rank_main
    unblocks it, instead of raising a KeyboardInterrupt inside the server's imports; the running server ignores
    it. The starter is told to leave the stop signals to the forwarder (SIGHUP and SIGQUIT it still raises as
    SignalException)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    saved_tempdir, saved_signals = tempfile.tempdir, os.environ.get(_TORCH_SIGNALS)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        start_method = "forkserver" if start_forkserver(RANK_MODULES) else "spawn"  # before the log dir below
        tempfile.tempdir = str(log_dir)  # torch's per-process error pickles, left behind when a rank fails
        os.environ[_TORCH_SIGNALS] = "SIGHUP,SIGQUIT"
        return start_processes(
            name="optimus",
            entrypoint=_rank_main,
            args={
                rank: (_Launch(dict(envs[rank]), os.getcwd(), os.getpid()), entrypoint, *args) for rank in range(nproc)
            },
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
            start_method=start_method,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        tempfile.tempdir = saved_tempdir
        if saved_signals is None:
            del os.environ[_TORCH_SIGNALS]
        else:
            os.environ[_TORCH_SIGNALS] = saved_signals
