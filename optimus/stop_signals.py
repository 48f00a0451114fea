"""How a command ends on a stop signal: one line (or none), never a traceback, nothing of it left running.

SIGTERM and SIGUSR1 (what PBS and SLURM send before a kill) end a command as Ctrl-C does, by an exception
raised where it is, so that its `finally` blocks run (its child processes end, what it half-wrote is removed);
`optimus.cli.main` catches it and says so in one line (`stopped`). The trainer and the local launcher put their
own handlers over these while they run (a stop at a step boundary) and put these back.

One kind of code cannot be unwound by such an exception: code running inside torch's dispatch modes (a dry run's
fake tensors and recorders). There the handler's exception can land between a mode's entry into torch's C++
mode stack and the Python that would leave it, and the unwinding then aborts the process in C++ ("trying to set
the current FakeTensorMode, but one already exists", then `terminate`). Inside `stops_end_the_process`
a stop signal ends the process at once instead.

Nothing here imports torch: `main` takes charge of stop signals before the seconds of torch's import.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class StopRequested(BaseException):
    """SIGTERM or SIGUSR1, raised where the command is, as Ctrl-C raises KeyboardInterrupt: a BaseException, so
    that no `except Exception` takes it for a failure."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


RAISED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # SIGINT raises KeyboardInterrupt already
# The stop signals, as optimus.local_launcher.FORWARDED_SIGNALS and optimus.train.faults.STOP_SIGNALS (both import
# torch; tests/test_signals.py holds the three equal).
ENDING_SIGNALS = (signal.SIGINT, *RAISED_SIGNALS)

# Whether the command running is its process's own (`optimus ...`), which a stop may end with os._exit, rather
# than a call of `main(argv)` from Python, whose interpreter is not the command's to end.
_command_is_the_process = False


def _raise_stop(signum, frame) -> None:
    raise StopRequested(signum)


@contextmanager
def stop_signals_raise(whole_process: bool) -> Iterator[None]:
    """While a command runs, SIGTERM and SIGUSR1 end it as Ctrl-C does: by an exception. Where one of them is
    ignored (nohup-like) it stays so. At the end they are restored (`main` also runs inside tests), except where
    the command ended by a stop and is the `whole_process`: ignored (`ignore_stop_signals`) until the
    interpreter has ended, as one line has said it all."""
    global _command_is_the_process
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in ENDING_SIGNALS}
    was_the_process, _command_is_the_process = _command_is_the_process, whole_process
    for sig in RAISED_SIGNALS:
        if previous[sig] == signal.SIG_DFL:
            signal.signal(sig, _raise_stop)
    try:
        yield
    finally:
        _command_is_the_process = was_the_process
        for sig, handler in previous.items():
            if not (whole_process and signal.getsignal(sig) == signal.SIG_IGN):
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python


@contextmanager
def stops_end_the_process() -> Iterator[None]:
    """Around code that runs inside torch's dispatch modes, which an exception from a signal handler may leave
    half-entered (see the module's docstring): where the command is its process, a stop signal (SIGINT,
    SIGTERM, SIGUSR1, where it would have raised) ends the process at once, as `stopped` ends a command: its
    child processes killed, the one line, 128 + the signal. Such code writes no file, so nothing is left
    half-written; its own `finally` blocks do not run. Called from Python instead (`main(argv)`, a script), the
    signal raises as elsewhere: that process is not the command's to end."""
    if not (_command_is_the_process and threading.current_thread() is threading.main_thread()):
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in ENDING_SIGNALS}
    for sig, handler in previous.items():
        if handler in (_raise_stop, signal.default_int_handler):  # not where ignored, or another's handler
            signal.signal(sig, _end_now)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is _end_now:
                signal.signal(sig, handler)


def _end_now(signum, frame) -> None:
    code = stopped(StopRequested(signum))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def ignore_stop_signals() -> None:
    """The command is ending by a stop, and has said so: another Ctrl-C must not break its cleanup into a
    traceback, nor add a line."""
    if threading.current_thread() is threading.main_thread():
        for sig in ENDING_SIGNALS:
            if signal.getsignal(sig) is not None:  # None: set outside Python, left alone
                signal.signal(sig, signal.SIG_IGN)


def _forget_interrupted_exec() -> None:
    """CPython (Python/pythonrun.c; met on 3.11) remembers a KeyboardInterrupt that left code run by `exec` of a
    string (a dataclass's generated __init__, as a module is imported) even where the command caught it, and
    `python -m optimus` then ends by killing itself with SIGINT instead of returning its exit code. Running a
    string through `exec` clears that flag; SIGINT is ignored by now, so nothing sets it again."""
    exec("pass")


def _end_child_processes() -> None:
    """Kill the processes this one started through multiprocessing and that still run (a dry run's tracing
    process, the machine's measuring ones): nothing will read their results, and a parent that exits while one
    runs waits for it (multiprocessing joins them at exit)."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join()


def stopped(stop: BaseException) -> int:
    """The command was stopped by a signal (`stop`: a StopRequested or a KeyboardInterrupt): end what it
    started, say so in one line, return 128 + the signal."""
    ignore_stop_signals()
    _forget_interrupted_exec()
    _end_child_processes()
    signum = stop.signum if isinstance(stop, StopRequested) else signal.SIGINT
    print(f"optimus: stopped by {str(stop) or signal.Signals(signum).name}.", file=sys.stderr)
    return 128 + signum
