"""A stop signal that comes while torch's dispatch modes run ends the command's process at once, without an
exception unwinding those modes (optimus.stop_signals; CI once met a dry run that, stopped by SIGTERM while
its fake tensors initialised a weight, aborted in C++ with 23 lines instead of one).

Each case runs a script in a process of its own: a dispatch mode whose handler sends the signal to its own
process, so that Python runs the signal's handler inside the mode, where the CI run met it."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

SCRIPT = """
import os, signal, sys, time
import multiprocessing
import torch
from optimus.kernels import torch_private as tp
from optimus.stop_signals import stop_signals_raise, stops_end_the_process

SIGNUM, WHOLE_PROCESS = signal.{signal}, {whole_process}


class SignalInside(tp.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        os.kill(os.getpid(), SIGNUM)  # its handler runs at one of the next bytecodes: inside this mode
        for _ in range(1000):
            pass
        return func(*args, **(kwargs or {{}}))


with stop_signals_raise(WHOLE_PROCESS):
    helper = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    helper.start()
    print(f"helper {{helper.pid}}", flush=True)
    try:
        with stops_end_the_process():
            with SignalInside():
                torch.ones(2) + 1
        print("not stopped", flush=True)
    except BaseException as stop:
        print(f"unwound by {{type(stop).__name__}}", flush=True)
    helper.kill()
    helper.join()
    # Outside the region a stop raises again, as everywhere in a command.
    try:
        os.kill(os.getpid(), SIGNUM)
        for _ in range(1000):
            pass
    except BaseException as stop:
        print(f"after it: {{type(stop).__name__}}", flush=True)
"""


def _run(signum: str, whole_process: bool) -> subprocess.CompletedProcess:
    code = SCRIPT.format(signal=signum, whole_process=whole_process)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT", "SIGUSR1"])
def test_a_stop_inside_dispatch_modes_ends_the_process_at_once(signum):
    result = _run(signum, whole_process=True)
    assert result.returncode == 128 + signal.Signals[signum], result.stdout + result.stderr
    assert "unwound" not in result.stdout and "not stopped" not in result.stdout, result.stdout
    assert result.stderr.strip() == f"optimus: stopped by {signum}.", result.stderr
    helper = int(result.stdout.split()[1])
    assert not _alive(helper), "the command's child process outlived it"


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_called_from_python_a_stop_raises_as_elsewhere(signum):
    """`main(argv)` from a script: the interpreter is not the command's to end, so the stop raises."""
    expected = "KeyboardInterrupt" if signum == "SIGINT" else "StopRequested"
    result = _run(signum, whole_process=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"unwound by {expected}" in result.stdout and f"after it: {expected}" in result.stdout, result.stdout
    assert not result.stderr.strip(), result.stderr
