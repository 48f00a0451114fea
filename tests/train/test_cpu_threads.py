"""CPU threads: how many intra-op threads a rank gets, how its OpenMP threads wait (docs/ARCHITECTURE.md, "CPU
threads"), and how run_info.json writes the cores a rank may run on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from optimus import cpu_runtime
from optimus.cpu_runtime import cpu_list, parse_cpu_list, share_cpu_threads


def openmp_settings(**user: str) -> str:
    """What the OpenMP runtime reports it uses (OMP_DISPLAY_ENV) once `optimus.cli` is imported, with the
    variables `user` sets (and no OMP_WAIT_POLICY of this environment's)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | user | {"OMP_DISPLAY_ENV": "VERBOSE"}
    proc = subprocess.run([sys.executable, "-c", "import optimus.cli"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if "GOMP_SPINCOUNT" not in proc.stderr:
        pytest.skip("torch's OpenMP runtime is not GNU libgomp here: it reports no spin count")
    return proc.stderr


def test_the_optimus_command_makes_waiting_openmp_threads_sleep():
    """Set before torch loads its OpenMP runtime, which reads it once: no spinning (libgomp spins 300,000
    times before it sleeps by default)."""
    assert "GOMP_SPINCOUNT = '0'" in openmp_settings()


def test_a_wait_policy_the_user_set_is_kept():
    settings = openmp_settings(OMP_WAIT_POLICY="ACTIVE")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in settings and "GOMP_SPINCOUNT = '0'" not in settings


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("cores, local_ranks, threads", [(8, 4, 2), (8, 3, 2), (2, 4, 1), (6, 1, 6)])
def test_each_local_rank_gets_its_share_of_the_cores(monkeypatch, restore_threads, cores, local_ranks, threads):
    """Local ranks split the cores of their affinity; one process keeps torch's default, one thread per core of
    its affinity (torch's OpenMP runtime counts those, as `taskset` would show)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_runtime, "available_cores", lambda: set(range(cores)))
    torch.set_num_threads(cores)  # what torch starts with on `cores` cores
    assert share_cpu_threads(local_ranks) == threads == torch.get_num_threads()


def test_omp_num_threads_overrides_the_share(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert share_cpu_threads(4) == 3


def test_a_process_under_taskset_gets_one_thread_per_core_it_may_use():
    """torch's default in a process pinned to one core, the case the single-process run relies on."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    # pinned before torch loads, as taskset or a batch system's binding would
    pin = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
    code = pin + "import torch; print(torch.get_num_threads())"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr


def test_cpu_lists_are_linux_cpulists():
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and cpu_list({3}) == "3"
    assert parse_cpu_list("0-2,5,7-8") == {0, 1, 2, 5, 7, 8} and parse_cpu_list("") == set()
