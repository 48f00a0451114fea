"""The helper processes a command starts, and the processes it watches: multiprocessing's forkserver (started
with Ctrl-C held back, importing what its children need once), its resource tracker (quiet about what a killed
process left), and the end of another process (a launcher, a command) noticed as it happens.

The local launcher's ranks (optimus.local_launcher) and the performance model's measuring and tracing processes
(optimus.perf.machine) are forked from the one forkserver of the process that starts them. Nothing here imports
torch.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


@contextmanager
def ctrl_c_held() -> Iterator[None]:
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


def start_forkserver(preload: Sequence[str]) -> bool:
    """Start this process's forkserver (a no-op once it runs), which imports the main module (as a spawned
    process would: functions defined there can be started) and the modules `preload` names once (its children
    then have them loaded: they start in a fraction of a second instead of importing torch), with
    Ctrl-C held (`ctrl_c_held`: its children start with SIGINT blocked too). Its socket goes to
    multiprocessing's own temporary directory, made now where none is yet. False where this platform has no
    forkserver."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(["__main__", *preload])  # none once it runs
    with ctrl_c_held():
        forkserver.ensure_running()
    return True


def process_exists(pid: int) -> bool:
    """Whether a process with this pid runs on this host (another user's included)."""
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


class ProcessEnd:
    """The end of process `pid` (not necessarily this one's parent), from now on: a pidfd where Linux has one
    (readable once the process has ended, before anyone reaps it; it names that process, whatever gets its pid
    later), else a poll of the pid every `poll_s`."""

    def __init__(self, pid: int, poll_s: float = 1.0):
        self.pid, self.poll_s = pid, poll_s
        self.ended_at_start = False
        self.pidfd: int | None = None
        try:
            self.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.ended_at_start = True
        except (AttributeError, OSError):  # no pidfd here: poll
            pass

    def has_ended(self) -> bool:
        if self.ended_at_start:
            return True
        if self.pidfd is not None:
            return bool(select.select([self.pidfd], [], [], 0)[0])
        return not process_exists(self.pid)

    def wait(self) -> None:
        """Return once the process has ended."""
        if self.pidfd is not None and not self.ended_at_start:
            select.select([self.pidfd], [], [])
            return
        while not self.has_ended():
            time.sleep(self.poll_s)
