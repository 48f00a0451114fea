"""Rank discovery for every launcher Optimus runs under, and local multi-process spawning.

`discover()` reads the environment a launcher leaves behind (torchrun, SLURM's srun, PBS/PALS
mpiexec on Aurora, MPICH hydra or Open MPI) and returns one `RankInfo`; `init_process_group()`
turns it into a torch.distributed process group. `spawn_local()` is what `parallel.nproc=N`
uses outside any launcher: it starts N processes with PyTorch's elastic process starter,
the same machinery as torchrun, passes stop signals on to them, names a rank that dies, and
its ranks end with it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from optimus.config import ConfigError
from optimus.kernels.torch_private import process_context_processes

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | slurm | pbs | mpi | none

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


class LaunchError(RuntimeError):
    """The launcher environment is incomplete; the message says what to set."""


# ---------------------------------------------------------------------------------------------
# Host lists


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside [...]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(body: str) -> list[str]:
    """'00012-00015,00020' -> ['00012', ..., '00015', '00020']; the width of the low end is kept."""
    out = []
    for item in body.split(","):
        lo, _, hi = item.strip().partition("-")
        if not hi:
            out.append(lo)
            continue
        width = len(lo)  # Slurm zero-pads every number to the width of the range's first one
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_host(pattern: str) -> list[str]:
    """One host pattern, possibly with several bracket groups: 'r[1-2]n[01-02]' -> 4 hosts."""
    m = re.search(r"\[([^\]]*)\]", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [head + mid + rest for mid in _expand_range_list(m.group(1)) for rest in _expand_host(tail)]


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list such as 'frontier[00012-00015,00020],login2' into hostnames."""
    if nodelist.count("[") != nodelist.count("]"):
        raise LaunchError(f"cannot parse the Slurm node list {nodelist!r}: its brackets do not balance.")
    hosts = []
    for part in _split_top_level(nodelist):
        hosts.extend(_expand_host(part))
    return hosts


def first_host_of_pbs_nodefile(path: str | os.PathLike) -> str:
    """First hostname listed in a PBS node file (one host per line; rank 0 runs there)."""
    try:
        lines = Path(path).read_text().split()
    except OSError as e:
        raise LaunchError(f"cannot read PBS_NODEFILE={path}: run inside a PBS job or set MASTER_ADDR.") from e
    if not lines:
        raise LaunchError(f"PBS_NODEFILE={path} is empty: run inside a PBS job or set MASTER_ADDR.")
    return lines[0]


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Slurm's compressed count list: '8(x2),4' means 8 tasks on nodes 0-1 and 4 on node 2."""
    counts = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise LaunchError(f"cannot parse the Slurm tasks-per-node value {tasks_per_node!r}.")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_id, len(counts) - 1)]


def _port_from_job_id(job_id: str | None) -> int:
    """A port that differs between jobs sharing a node, so two jobs' rendezvous do not clash."""
    digits = re.match(r"\d+", job_id or "")
    return 20000 + int(digits.group()) % 10000 if digits else DEFAULT_PORT


# ---------------------------------------------------------------------------------------------
# Discovery, one function per launcher; each returns None when its launcher is not present.


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            return int(env[name])
    return None


def _from_torchrun(env: Mapping[str, str]) -> RankInfo | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    local_world = _int(env, "LOCAL_WORLD_SIZE") or world
    return RankInfo(
        rank=int(env["RANK"]),
        local_rank=_int(env, "LOCAL_RANK") or 0,
        world_size=world,
        local_world_size=local_world,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT") or DEFAULT_PORT,
        launcher="torchrun",
    )


def _from_slurm(env: Mapping[str, str]) -> RankInfo | None:
    # SLURM_PROCID is also set in the batch script itself; only an srun step sets SLURM_STEP_ID.
    if "SLURM_PROCID" not in env or not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return None
    world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or 1
    if world == 1:  # a one-task step, such as `srun --pty bash`: a shell, not a job to join
        return None
    per_node = next(
        (env[k] for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(k)),
        None,
    )
    if per_node:
        local_world = _tasks_on_node(per_node, _int(env, "SLURM_NODEID") or 0)
    else:
        local_world = world // (_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    elif nodelist:
        addr = parse_slurm_nodelist(nodelist)[0]
    elif world == local_world:
        addr = "127.0.0.1"
    else:
        raise LaunchError("SLURM_NODELIST is not set in a multi-node srun step: set MASTER_ADDR to rank 0's host.")
    return RankInfo(
        rank=int(env["SLURM_PROCID"]),
        local_rank=_int(env, "SLURM_LOCALID") or 0,
        world_size=world,
        local_world_size=local_world,
        master_addr=addr,
        master_port=_port_from_job_id(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")),
        launcher="slurm",
    )


def _from_pals(env: Mapping[str, str]) -> RankInfo | None:
    # Aurora's mpiexec is HPE Cray PALS; it sets PALS_* and the PMI_* sizes.
    if "PALS_RANKID" not in env:
        return None
    local_world = _int(env, "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE") or 1
    world = _int(env, "PMI_SIZE", "PALS_SIZE", "PALS_NRANKS")
    if world is None:
        raise LaunchError("PALS_RANKID is set but PMI_SIZE is not: set PMI_SIZE to the number of ranks.")
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    elif env.get("PBS_NODEFILE"):
        addr = first_host_of_pbs_nodefile(env["PBS_NODEFILE"])
    elif world == local_world:
        addr = "127.0.0.1"
    else:
        raise LaunchError("PBS_NODEFILE is not set in a multi-node PALS job: set MASTER_ADDR to rank 0's host.")
    return RankInfo(
        rank=int(env["PALS_RANKID"]),
        local_rank=_int(env, "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK") or 0,
        world_size=world,
        local_world_size=local_world,
        master_addr=addr,
        master_port=_port_from_job_id(env.get("PBS_JOBID")),
        launcher="pbs",
    )


def _from_mpi(env: Mapping[str, str]) -> RankInfo | None:
    if "OMPI_COMM_WORLD_RANK" in env:  # Open MPI's mpirun
        rank, world = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or world
    elif "PMI_RANK" in env and "PMI_SIZE" in env:  # MPICH hydra mpiexec, Intel MPI
        rank, world = int(env["PMI_RANK"]), int(env["PMI_SIZE"])
        local_rank = _int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK") or 0
        local_world = _int(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE") or world
    else:
        return None
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    elif world == local_world:
        addr = "127.0.0.1"
    elif env.get("PBS_NODEFILE"):
        addr = first_host_of_pbs_nodefile(env["PBS_NODEFILE"])
    elif env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"):
        addr = parse_slurm_nodelist(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])[0]
    else:
        raise LaunchError("a multi-node MPI launch does not name rank 0's host: export MASTER_ADDR=<host of rank 0>.")
    return RankInfo(rank, local_rank, world, local_world, addr, DEFAULT_PORT, "mpi")


def discover(env: Mapping[str, str] = os.environ) -> RankInfo:
    """Rank, world and rendezvous address from the launcher's environment; MASTER_ADDR/PORT win."""
    for probe in (_from_torchrun, _from_slurm, _from_pals, _from_mpi):
        info = probe(env)
        if info is not None:
            break
    else:
        info = RankInfo(0, 0, 1, 1, "127.0.0.1", DEFAULT_PORT, "none")
    if not 0 <= info.rank < info.world_size or not 0 <= info.local_rank < info.local_world_size:
        raise LaunchError(
            f"the {info.launcher} environment gives rank {info.rank} (local {info.local_rank}) outside world "
            f"{info.world_size} (local {info.local_world_size}): check the launcher's task counts."
        )
    if env.get("MASTER_PORT"):
        info = replace(info, master_port=int(env["MASTER_PORT"]))
    return info


# ---------------------------------------------------------------------------------------------
# Process groups


def init_process_group(info: RankInfo, backend: str, device: torch.device, timeout_s: float) -> None:
    """env:// rendezvous at info.master_addr:master_port; binds the device where the backend can."""
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
        RANK=str(info.rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_RANK=str(info.local_rank),
    )
    kwargs: dict[str, Any] = {}
    if backend in ("nccl", "xccl") and device.type != "cpu":
        kwargs["device_id"] = device  # eager init: the communicator is built now, on this device
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------
# Local spawning


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
_LAUNCHER_PID = "OPTIMUS_LAUNCHER_PID"  # the process that started the ranks (their parent)


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

LAUNCHER_POLL_S = 1.0  # how often a rank looks for its launcher
ORPHAN_EXIT_S = 20.0  # after the launcher has gone: time to save at a step boundary before the rank ends anyway
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _set_parent_death_signal(sig: signal.Signals) -> None:
    """Linux: the kernel sends `sig` to this process when its parent dies (immediate; the poll is the fallback)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl in this libc: polling the parent pid still notices


class _LauncherWatch:
    """Notices that the launcher has gone, asks the rank to stop as SIGTERM does (it saves at the next step
    boundary: optimus.train.faults), and ends the process if that has not happened within ORPHAN_EXIT_S."""

    def __init__(self, launcher_pid: int):
        self.launcher_pid = launcher_pid

    def start(self) -> None:
        _set_parent_death_signal(signal.SIGTERM)
        # The launcher is the ranks' parent (torch's starter runs inside it); if it died before the line above,
        # the parent pid has changed already and the first poll sees it.
        threading.Thread(target=self._watch, name="optimus-launcher-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.launcher_gone():
            time.sleep(LAUNCHER_POLL_S)
        _remove_spawn_dir()
        os.kill(os.getpid(), signal.SIGTERM)  # where the parent-death signal is missing or came too early
        time.sleep(ORPHAN_EXIT_S)
        self.exit(1)  # stuck (in a collective with a rank that has ended): no one will come for it

    def launcher_gone(self) -> bool:
        return os.getppid() != self.launcher_pid

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


def _rank_main(entrypoint: Callable, *args) -> Any:
    """What spawn_local runs in each rank: `entrypoint(*args)`, ending with the launcher."""
    signal.signal(signal.SIGINT, _end_at_start_up)
    # The launcher started this process with SIGINT blocked, so that a Ctrl-C (which reaches every process of
    # the terminal's group) while it imported torch waited for here instead of raising a KeyboardInterrupt
    # somewhere in those imports: a pending one takes effect now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    watch = _LauncherWatch(int(os.environ[_LAUNCHER_PID]))
    watch.start()
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


def _failed_ranks(ranks: Any) -> dict[int, int]:
    """{rank: exit code} of the ranks that have ended with a failure (negative: the signal that ended them).
    torch's process context keeps the processes; only it can tell each one's exit code."""
    codes = {rank: process.exitcode for rank, process in enumerate(process_context_processes(ranks))}
    return {rank: code for rank, code in codes.items() if code not in (None, 0)}


def _wait(ranks: Any, log_dir: Path, forwarder: _Forwarder) -> tuple[Any, dict[int, int]]:
    """Poll until every rank ended; returns torch's result and the first ranks seen failing, with their exit
    codes (the others mostly fail because of them). Once one has failed, the others are stuck in a collective:
    after a short grace they are killed, rather than waited for until a timeout."""
    failed_at, first_failed = None, {}
    while True:
        forwarder.kill_if_requested(process_context_processes(ranks))
        first_failed = first_failed or _failed_ranks(ranks)  # before torch's poll reaps the rest
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


def quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (shared by the processes this one starts) unable to warn about
    the semaphores of a process that was killed: it removes them, and its warning after the one line that says
    what happened is noise."""
    from multiprocessing import resource_tracker

    saved = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = "ignore::UserWarning:multiprocessing.resource_tracker"
    try:
        with ctrl_c_held():  # it ignores Ctrl-C once running; blocked from its start too
            resource_tracker.ensure_running()  # a no-op when it runs already
    finally:
        if saved is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = saved


@contextmanager
def ctrl_c_held():
    """The helper processes started in this block begin with SIGINT blocked (a thread's signal mask survives
    fork and exec): a Ctrl-C, which reaches the terminal's whole group, then cannot end one with a traceback as
    it imports its modules; running, they ignore SIGINT. This process keeps its Ctrl-C: one that comes during
    the block (taken by another thread, or waiting until the mask is restored) is held and raised once the block
    is over, so nothing it starts is interrupted half-way. (Ignoring SIGINT instead, SIG_IGN, would be inherited
    too, but would lose a Ctrl-C that came in the block.)"""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a Ctrl-C that waited is taken now, by the holder
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)  # None: set outside Python
        if held:
            os.kill(os.getpid(), signal.SIGINT)


def spawn_local(nproc: int, entrypoint: Callable, args: tuple = (), run_id: str | None = None) -> dict[int, Any]:
    """Run `entrypoint(*args)` in `nproc` fresh processes; returns {rank: value}.

    `entrypoint` must be importable by name (a module-level function): children are spawned,
    not forked. Each child sees the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so
    `discover()` works inside it. Unlike torchrun's agent, which kills the ranks 30 s after a
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
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, _SPAWN_DIR: str(log_dir),
            "TORCHELASTIC_RUN_ID": run_id or f"optimus-{os.getpid()}", _LAUNCHER_PID: str(os.getpid()),
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


def _start_ranks(nproc: int, entrypoint: Callable, args: tuple, envs: dict, log_dir: Path) -> Any:
    """torch's elastic process starter, with SIGINT blocked while it starts the ranks: they inherit the mask and
    unblock it in _rank_main, so a Ctrl-C (which reaches every process of the terminal's group) waits there
    instead of raising a KeyboardInterrupt inside their imports of torch (SIGTERM and SIGUSR1 end them
    silently then). The starter is told to leave the stop signals to the forwarder (SIGHUP and SIGQUIT it still
    raises as SignalException)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    saved_tempdir, saved_signals = tempfile.tempdir, os.environ.get(_TORCH_SIGNALS)
    tempfile.tempdir = str(log_dir)  # torch's per-process error pickles, left behind when a rank fails
    os.environ[_TORCH_SIGNALS] = "SIGHUP,SIGQUIT"
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        return start_processes(
            name="optimus",
            entrypoint=_rank_main,
            args={rank: (entrypoint, *args) for rank in range(nproc)},
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
            start_method="spawn",
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        tempfile.tempdir = saved_tempdir
        if saved_signals is None:
            del os.environ[_TORCH_SIGNALS]
        else:
            os.environ[_TORCH_SIGNALS] = saved_signals
