"""Choosing, creating and claiming the run directory, the same one on every rank."""

from __future__ import annotations

import atexit
import errno
import json
import math
import os
import shutil
import signal
import socket
import stat
import threading
import time
from fcntl import LOCK_EX, LOCK_NB, flock
from pathlib import Path

import torch.distributed as dist

from optimus.config import ConfigError, OptimusConfig
from optimus.parallel import ParallelState
from optimus.processes import process_exists
from optimus.train.checkpoint_dirs import LATEST, TMP_SUFFIX, checkpoint_root, has_checkpoint, published
from optimus.train.metrics import NO_SPACE, wandb_refusal, write_text_atomic


def default_run_dir(cfg: OptimusConfig) -> Path:
    return Path("runs") / f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _same_command(cfg: OptimusConfig, run_dir: Path, *settings: str) -> str:
    """The same command (with `settings` added), pinned to this run directory when the run chose one itself."""
    settings = ([] if cfg.run.dir else [f"run.dir={run_dir}"]) + list(settings)
    return f"the same command with {' '.join(settings)}" if settings else "the same command again"


def resume_hint(cfg: OptimusConfig, run_dir: Path) -> str:
    """How to resume this run (run.overwrite=true would start it over instead)."""
    how = _same_command(cfg, run_dir) + (" but without run.overwrite=true" if cfg.run.overwrite else "")
    return f"run {how} to resume"


def next_command(cfg: OptimusConfig, run_dir: Path) -> str:
    """What to run once a failure is fixed, as the directories now stand (the rules of _refuse_reuse): resume
    from a checkpoint; start the run over where its records, without a checkpoint, are refused otherwise; or
    run the same command again."""
    if has_checkpoint(checkpoint_root(cfg, run_dir)):
        return resume_hint(cfg, run_dir)
    if _refuse_reuse(cfg, run_dir):
        return f"run {_same_command(cfg, run_dir, 'run.overwrite=true')} to start it over"
    return f"run {_same_command(cfg, run_dir)}"


def holds_run(run_dir: Path) -> bool:
    """True when run_dir has step records; a metrics.jsonl that is empty, or holds only the starting evaluation
    (step 0), is a run that died before its first step."""
    return (last_record_step(run_dir) or 0) > 0


def last_record_step(run_dir: Path) -> float | None:
    """The highest step of metrics.jsonl's records (inf for a line cut short), or None without records."""
    path = Path(run_dir) / "metrics.jsonl"
    steps = [_record_step(line) for line in path.read_text().splitlines()] if path.exists() else []
    return max(steps, default=None)


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Keep the records of steps <= `step` (a resumed run re-does, and re-logs, the steps after its checkpoint);
    a run that starts at step 0 keeps none (it logs its starting evaluation again)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True) if step > 0 else []
    write_text_atomic(path, "".join(line for line in lines if _record_step(line) <= step))


def _record_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a line cut short by a kill


# What a run writes at the top of its directory, metrics.jsonl first (a directory that holds the others without
# it was not left by a run), and the files profile.* has it write beside them.
RUN_FILES = ("metrics.jsonl", "run_info.json", "config.yaml")
RUN_OUTPUTS = ("trace_rank*.json", "collectives/rank*.json", "host_syncs/rank*.json", "memory/rank*.json")
_created: list[Path] = []  # run directories this process made (removed again if a failed start left them empty)


def _run_traces(cfg: OptimusConfig, run_dir: Path) -> list[str]:
    """The files in run_dir (and the checkpoint directory) that a run would write over, by name."""
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    found += sorted(str(p.relative_to(run_dir)) for pattern in RUN_OUTPUTS for p in run_dir.glob(pattern))
    root = checkpoint_root(cfg, run_dir)
    if root.is_dir():  # a save's staging directory, or `latest` (published checkpoints are resumed)
        found += sorted(str(p) for p in root.iterdir() if p.name.startswith("step_") or p.name == LATEST)
    return found


def _refuse_reuse(cfg: OptimusConfig, run_dir: Path) -> str | None:
    """Why `run_dir` cannot take this run: it holds another run's records but no checkpoint to resume, or files
    that a run writes without the metrics.jsonl that every run writes first (not a run's, or not Optimus's). A
    run that died before its first step (its metrics.jsonl empty, or the starting evaluation only) is no run to
    keep: its files are replaced."""
    if cfg.run.overwrite or has_checkpoint(checkpoint_root(cfg, run_dir)):
        return None  # resumed (the checkpoint's settings are compared on load), or started afresh on request
    if holds_run(run_dir):
        return (
            f"run.dir={run_dir} already holds a run (metrics.jsonl) without a checkpoint to resume from: "
            "choose another run.dir, or pass run.overwrite=true to replace that run."
        )
    found = [] if (run_dir / "metrics.jsonl").exists() else _run_traces(cfg, run_dir)
    if found:
        return (
            f"run.dir={run_dir} holds {', '.join(found)}, which a run would overwrite, but no metrics.jsonl (the "
            "first file a run writes), so they are not a run to resume: move them away, choose another run.dir, "
            "or pass run.overwrite=true to replace them."
        )
    return None


def clear_run(cfg: OptimusConfig, run_dir: Path) -> None:
    """run.overwrite=true: remove the old run's records and checkpoints (nothing else in the directory)."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    root = checkpoint_root(cfg, run_dir)
    if root.is_dir():
        for path in [*published(root), *root.glob(f"step_*{TMP_SUFFIX}")]:
            shutil.rmtree(path, ignore_errors=True)
        (root / LATEST).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The claim: one run at a time in a run directory, and in a checkpoint directory (a job requeued while its
# predecessor still runs, a second command started by mistake, two runs given the same checkpoint.dir). Rank 0
# holds both from before it touches them until the run ends.
#
# CLAIM_FILE records the holder's host and pid; the holder touches it every HEARTBEAT_S (its heartbeat). Where
# flock works, the holder also holds an flock on it, which the kernel (or the file system's lock manager) drops
# when the process dies, however it dies. Lustre (Aurora, Frontier) gives flock only on mounts with the `flock`
# option: elsewhere it fails (ENOSYS and kin) or, with `localflock`, locks only on its own node. So a claim
# file is also held while its heartbeat is fresh, unless its holder ran on this host and its pid has ended;
# a successor breaks it once the heartbeat is STALE_AFTER_S old. A holder that was paused that long (SIGSTOP, a
# frozen file system) may find its claim taken over: it then stops at its next step boundary, writing nothing.

CLAIM_FILE = ".optimus-claim"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 4 * HEARTBEAT_S  # several beats missed: the holder is gone (or stopped)
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}  # flock is not offered on this file system
# A claim file is opened where it is, never through a link (which would have its target rewritten and removed),
# and without waiting on a named pipe.
_NO_LINK = os.O_NOFOLLOW | os.O_NONBLOCK
_HOST = socket.gethostname()


class ClaimLost(ConfigError):
    """Another run took over a directory this run had claimed (its claim went stale while it was paused)."""


class RunClaim:
    """This process's claim on a directory: the open claim file (and its flock, where flock works) and the
    thread that beats its heartbeat. `setting` names the directory in messages ("run.dir", "checkpoint.dir")."""

    def __init__(self, directory: Path, setting: str, fd: int):
        self.directory, self.setting, self.fd = directory, setting, fd  # the directory as the user named it
        self.path = directory.resolve() / CLAIM_FILE
        self.lost: str | None = None  # why the claim is no longer ours, once it was found so
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="optimus-run-claim", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self.check():
                return  # taken over: beating would renew the successor's claim (with flock it is the same file)
            try:
                os.utime(self.fd)  # this file, even if a successor has replaced the path meanwhile
            except OSError:
                pass  # a passing file-system error: the next beat tries again

    def check(self) -> str | None:
        """Why the claim is no longer this process's (the file at its path was removed, or replaced or rewritten
        by a successor), else None."""
        if self.lost is None:
            try:
                holder = _read_holder(self.fd) if _is_current(self.fd, self.path) else None
            except OSError:
                return None  # a passing file-system error: the next look decides
            if not holder or (holder["host"], holder["pid"]) != (_HOST, os.getpid()):
                self.lost = self._lost_message()
        return self.lost

    def _lost_message(self) -> str:
        try:
            fd = os.open(self.path, os.O_RDONLY | _NO_LINK)
        except OSError:
            holder = None
        else:
            holder = _read_holder(fd)
            os.close(fd)
        who = _describe(holder) if holder else "another run (its claim file was removed or rewritten)"
        return (
            f"{self.setting}={self.directory} was taken over by {who} after this run's claim on it went stale (no "
            f"heartbeat for {STALE_AFTER_S:.0f} s: the process was paused or its file system stalled), so this run "
            f"stopped without writing anything more there: let that run finish, or give this one another "
            f"{self.setting}."
        )

    def release(self) -> None:
        self._stop.set()
        self._beat.join()
        if self.check() is None:  # never a successor's file
            self.path.unlink(missing_ok=True)
        os.close(self.fd)  # drops the flock after the file is gone


_claims: dict[Path, RunClaim] = {}  # the directories this process holds
_previous_sigterm: list = []  # the SIGTERM handler the claim replaced (see _release_on_sigterm)


def _is_current(fd: int, path: Path) -> bool:
    """The open file `fd` is still the one at `path` (not removed, nor replaced by a successor's)."""
    try:
        on_disk, held = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def _holder_record() -> bytes:
    return json.dumps({"host": _HOST, "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()


def _create(path: Path) -> int | None:
    """Create the claim file, holder record included, in one atomic step (a hard link, which network file
    systems also make atomically): its descriptor, or None when the file exists."""
    staged = path.with_name(f"{path.name}.{_HOST}.{os.getpid()}.tmp")
    staged.unlink(missing_ok=True)  # left by an earlier process of this pid that was killed here
    try:
        fd = _create_exclusively(staged)
        if fd is None:  # removed above: only another process of this pid could have made it
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(staged))
        os.close(fd)
        try:
            os.link(staged, path)
        except FileExistsError:
            return None
        except OSError:  # a file system without hard links: create it exclusively, then write the record
            return _create_exclusively(path)
    finally:
        staged.unlink(missing_ok=True)
    return os.open(path, os.O_RDWR | _NO_LINK)


def _create_exclusively(path: Path) -> int | None:
    """Create `path` holding this process's record (O_EXCL: never through a link): its descriptor, or None when
    it exists. A record that cannot be written (a full disk) leaves no file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    try:
        os.write(fd, _holder_record())
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def _read_holder(fd: int) -> dict | None:
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        return record if isinstance(record, dict) and isinstance(record.get("pid"), int) and "host" in record else None
    except (OSError, ValueError):
        return None  # being rewritten by a successor that took over the file


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a record left by an earlier process that had this pid: this process holds no claim here
    return process_exists(pid)


def _held_by_another(fd: int, flocked: bool) -> bool:
    """Whether another run holds this existing claim file (False: it may be taken over)."""
    holder = _read_holder(fd)
    if flocked and (holder is None or holder["host"] == _HOST):
        return False  # our flock proves its holder on this host gone; a file naming no holder has none
    if holder and holder["host"] == _HOST and not _pid_alive(holder["pid"]):
        return False  # the holder's ended pid proves it gone
    return time.time() - os.fstat(fd).st_mtime < STALE_AFTER_S  # its heartbeat


def _flock(fd: int) -> bool | None:
    """True: this process now holds the flock; False: flock is not available here; None: another holds it."""
    try:
        flock(fd, LOCK_EX | LOCK_NB)
    except BlockingIOError:
        return None
    except OSError as err:
        if err.errno not in _NO_FLOCK:
            raise
        return False
    return True


def _describe(holder: dict) -> str:
    since = f", since {holder['since']}" if "since" in holder else ""
    return f"another run (pid {holder['pid']} on host {holder['host']}{since})"


def _busy(directory: Path, setting: str, fd: int, flocked: bool | None) -> ConfigError:
    """The refusal: who holds the claim in `fd`, and, where its heartbeat decides (no flock of ours could
    tell), when it expires if that run has ended (a job requeued on another node may be that early)."""
    holder = _read_holder(fd)
    who = _describe(holder) if holder else "another run that has not recorded its host and pid yet"
    if flocked is None:  # its flock: that process is alive
        return ConfigError(
            f"{setting}={directory} is in use by {who}: wait until it ends, or choose another {setting}."
        )
    expires = os.fstat(fd).st_mtime + STALE_AFTER_S
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(expires))
    return ConfigError(
        f"{setting}={directory} is in use by {who}, whose claim expires at {when} (in {expires - time.time():.0f} "
        f"s) if that run has ended (a running one renews it every {HEARTBEAT_S:.0f} s): run the same command again "
        f"after that, or choose another {setting}."
    )


def _not_a_claim(directory: Path, setting: str, path: Path) -> ConfigError:
    """The refusal of a CLAIM_FILE that is not a regular file (a link to another file, a directory, a pipe)."""
    mode = os.lstat(path).st_mode
    kinds = {stat.S_ISLNK: "a symbolic link", stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a named pipe"}
    kind = next((name for test, name in kinds.items() if test(mode)), "not a regular file")
    return ConfigError(
        f"{setting}={directory} holds {CLAIM_FILE}, which is {kind}, not the claim file a run writes there (which "
        f"would replace it): move it away, or choose another {setting}."
    )


def _try_claim(directory: Path, setting: str) -> RunClaim | ConfigError | None:
    """One attempt; None when the file changed under it (released, or broken by another) and it is worth
    another look."""
    path = directory.resolve() / CLAIM_FILE
    fd = _create(path)
    created = fd is not None
    if fd is None:
        try:
            fd = os.open(path, os.O_RDWR | _NO_LINK)
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise
            return _not_a_claim(directory, setting, path)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return _not_a_claim(directory, setting, path)
    try:
        flocked = _flock(fd)
        if flocked is not None and not _is_current(fd, path):
            os.close(fd)
            return None
        if flocked is None or (not created and _held_by_another(fd, flocked)):
            busy = _busy(directory, setting, fd, flocked)
            os.close(fd)
            return busy
        if not created:
            if not flocked:  # a stale claim without flock: remove it, then create ours atomically
                if _is_current(fd, path):  # (two successors breaking the same stale claim: one removes it)
                    path.unlink(missing_ok=True)
                os.close(fd)
                return None
            record = _holder_record()  # flocked: the file is ours; its record names us from now on
            os.pwrite(fd, record, 0)
            os.ftruncate(fd, len(record))
        os.utime(fd)
    except BaseException:
        os.close(fd)
        raise
    return RunClaim(directory, setting, fd)


def claim_dir(directory: Path, setting: str = "run.dir") -> ConfigError | None:
    """Claim `directory` (an existing one) for this process, or say which run holds it."""
    key = directory.resolve()
    if key in _claims:
        return None  # this process holds it already (a second Trainer of the same run)
    try:
        for _ in range(3):  # a claim released or broken while we looked: look again
            outcome = _try_claim(directory, setting)
            if isinstance(outcome, ConfigError):
                return outcome
            if outcome is not None:
                if not _claims:
                    _release_on_sigterm()
                _claims[key] = outcome
                return None
    except OSError as err:
        return ConfigError(f"{setting}={directory} cannot be claimed for this run {_why_not(err, directory, setting)}")
    return ConfigError(
        f"{setting}={directory} is in use by another run: wait until it ends, or choose another {setting}."
    )


def lost_claim() -> str | None:
    """Why this process no longer holds a directory it claimed, in one sentence; None while it holds them all
    (or holds none: ranks other than 0). Rank 0 asks at every step."""
    return next((lost for claim in _claims.values() if (lost := claim.check())), None)


def release_claims() -> None:
    """Give up every directory this process holds (the end of a run, or a failed start)."""
    while _claims:
        _claims.popitem()[1].release()
    while _previous_sigterm:
        handler = _previous_sigterm.pop()
        if signal.getsignal(signal.SIGTERM) is _terminate_after_release:
            signal.signal(signal.SIGTERM, handler)


def _terminate_after_release(signum, frame) -> None:
    release_claims()  # puts back the default action
    os.kill(os.getpid(), signum)


def _release_on_sigterm() -> None:
    """SIGTERM before the trainer turns it into a stop at a step boundary (or after): release, then end as
    SIGTERM would. Other deaths leave the file to the rules above."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        _previous_sigterm.append(signal.signal(signal.SIGTERM, _terminate_after_release))


atexit.register(release_claims)


def _make_dir(directory: Path, setting: str) -> ConfigError | None:
    """Create `directory` (recorded, to be removed again if this process leaves it empty) and check that it
    takes files."""
    if directory.exists() and not directory.is_dir():
        return ConfigError(f"{setting}={directory} is a file, not a directory: choose another {setting}.")
    try:
        if not directory.exists():
            directory.mkdir(parents=True)
            _created.append(directory.resolve())
        probe = directory / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        return ConfigError(f"{setting}={directory} cannot be written {_why_not(err, directory, setting)}")
    return None


def _why_not(err: OSError, directory: Path, setting: str) -> str:
    """The end of a sentence saying why a file cannot be created in `directory`: its disk is full, or this user
    may not create files there."""
    if err.errno in NO_SPACE:
        return f"({NO_SPACE[err.errno]} {directory}): free space there, or choose another {setting}."
    return f"({err.strerror}): choose a {setting} where you may create files."


def _claim_checkpoint_root(cfg: OptimusConfig, run_dir: Path) -> ConfigError | None:
    """The checkpoint directory is claimed too, unless it is the run directory itself: another run may name it
    as its checkpoint.dir from another run.dir, and the two would replace each other's checkpoints."""
    root = checkpoint_root(cfg, run_dir)
    if root.resolve() == run_dir.resolve() or (root.exists() and not root.is_dir()):
        return None  # the run directory's claim covers it; a file: the Checkpointer refuses it
    return _make_dir(root, "checkpoint.dir") or claim_dir(root, "checkpoint.dir")


def _make_run_dir(cfg: OptimusConfig, run_dir: Path) -> Path | ConfigError:
    # Claimed before this run reads or writes anything of the directories' (a refusal releases what it took).
    refusal = _make_dir(run_dir, "run.dir") or claim_dir(run_dir) or _claim_checkpoint_root(cfg, run_dir)
    if refusal is None:
        problem = _refuse_reuse(cfg, run_dir)
        refusal = ConfigError(problem) if problem else None
    if refusal:
        release_claims()
        return refusal
    if cfg.run.overwrite:
        clear_run(cfg, run_dir)
    return run_dir.resolve()


def remove_if_empty() -> None:
    """At the end of a run or a failed start: give up the claims, and drop the directories this process created
    and left empty (a run directory whose run failed to start, a checkpoint directory no checkpoint went into)."""
    release_claims()
    while _created:
        path = _created.pop()  # the newest first: a checkpoint directory inside the run directory goes first
        try:
            path.rmdir()  # only succeeds on an empty directory
        except OSError:
            pass


def resolve_run_dir(cfg: OptimusConfig, ps: ParallelState) -> Path:
    """Rank 0 decides (a timestamp could differ between ranks) and tells the others; so does a refusal."""
    chosen: list[Path | ConfigError | None] = [None]
    if ps.is_main:  # wandb would refuse only after the run wrote its first files: asked here, before any
        refusal = wandb_refusal() if cfg.logging.wandb else None
        chosen[0] = refusal or _make_run_dir(cfg, Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg))
    if ps.is_distributed:
        dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], Exception):
        raise chosen[0]
    return chosen[0]
