"""Rank discovery from fabricated launcher environments, and a real two-process local spawn."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from optimus.local_launcher import SpawnError, spawn_local
from optimus.ranks import (
    LaunchError,
    RankInfo,
    discover,
    first_host_of_pbs_nodefile,
    init_process_group,
    parse_slurm_nodelist,
)

# ---------------------------------------------------------------------------------------------
# Slurm host lists


@pytest.mark.parametrize(
    "nodelist, expected",
    [
        ("node001", ["node001"]),
        ("a[1-3],b5", ["a1", "a2", "a3", "b5"]),
        (
            "frontier[00012-00015,00020],login2",
            ["frontier00012", "frontier00013", "frontier00014", "frontier00015", "frontier00020", "login2"],
        ),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),  # padding kept across a change of digit count
        ("n[9-11]", ["n9", "n10", "n11"]),  # no padding when the low end has none
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),  # several bracket groups
        ("x[1,3],y[001-002],z", ["x1", "x3", "y001", "y002", "z"]),
    ],
)
def test_parse_slurm_nodelist(nodelist, expected):
    assert parse_slurm_nodelist(nodelist) == expected


def test_parse_slurm_nodelist_rejects_unbalanced_brackets():
    with pytest.raises(LaunchError, match="brackets"):
        parse_slurm_nodelist("node[1-3")


# ---------------------------------------------------------------------------------------------
# One environment per launcher


def test_no_launcher_is_a_single_process():
    assert discover({}) == RankInfo(0, 0, 1, 1, "127.0.0.1", 29500, "none")


def test_torchrun():
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "nodeA",
        "MASTER_PORT": "1234",
    }
    assert discover(env) == RankInfo(5, 1, 8, 4, "nodeA", 1234, "torchrun")
    assert discover(env).node_rank == 1


def slurm_env(**extra: str) -> dict[str, str]:
    env = {
        "SLURM_PROCID": "13",
        "SLURM_LOCALID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_NODEID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "1234567",
        "SLURM_NODELIST": "frontier[00012-00013]",
    }
    env.update(extra)
    return env


def test_slurm_with_ntasks_per_node_and_compressed_nodelist():
    info = discover(slurm_env(SLURM_NTASKS_PER_NODE="8"))
    assert info == RankInfo(13, 5, 16, 8, "frontier00012", 20000 + 1234567 % 10000, "slurm")


def test_slurm_tasks_per_node_compressed_counts():
    # '8(x2),4': nodes 0 and 1 run 8 tasks, node 2 runs 4.
    env = slurm_env(SLURM_TASKS_PER_NODE="8(x2),4", SLURM_NTASKS="20", SLURM_PROCID="17", SLURM_LOCALID="1")
    env["SLURM_NODEID"] = "2"
    assert discover(env).local_world_size == 4
    env.update(SLURM_NODEID="1", SLURM_PROCID="9")
    assert discover(env).local_world_size == 8


def test_slurm_job_nodelist_and_env_master_wins():
    env = slurm_env(SLURM_NTASKS_PER_NODE="8")
    del env["SLURM_NODELIST"]
    env["SLURM_JOB_NODELIST"] = "gpu[7,9]"
    assert discover(env).master_addr == "gpu7"
    env.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="4000")
    info = discover(env)
    assert (info.master_addr, info.master_port, info.launcher) == ("10.0.0.1", 4000, "slurm")


def test_slurm_batch_script_without_srun_is_not_a_rank():
    # The batch step sets SLURM_PROCID=0 and SLURM_NTASKS=N but is one process, not N.
    env = slurm_env(SLURM_PROCID="0", SLURM_LOCALID="0")
    del env["SLURM_STEP_ID"]
    assert discover(env).launcher == "none"


def test_one_task_slurm_step_is_an_interactive_shell():
    # `srun --pty bash` then `optimus train parallel.nproc=4` must spawn locally, not join a 1-rank job.
    env = slurm_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1")
    assert discover(env).launcher == "none"


def test_pbs_pals_on_aurora(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x4102c5s2b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov\nx4102c5s3b0n0.hostmgmt2102.cm.aurora\n")
    env = {
        "PALS_RANKID": "14",
        "PALS_LOCAL_RANKID": "2",
        "PALS_LOCAL_SIZE": "12",
        "PMI_RANK": "14",
        "PMI_SIZE": "24",
        "PBS_NODEFILE": str(nodefile),
        "PBS_JOBID": "4321.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov",
    }
    info = discover(env)
    assert info == RankInfo(14, 2, 24, 12, "x4102c5s2b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov", 24321, "pbs")
    assert first_host_of_pbs_nodefile(nodefile) == info.master_addr


def test_pbs_missing_nodefile_is_explained(tmp_path):
    env = {"PALS_RANKID": "0", "PALS_LOCAL_RANKID": "0", "PALS_LOCAL_SIZE": "12", "PMI_SIZE": "24"}
    env["PBS_NODEFILE"] = str(tmp_path / "gone")
    with pytest.raises(LaunchError, match="PBS_NODEFILE"):
        discover(env)


def test_cli_reports_a_launch_error_in_one_sentence(monkeypatch, capsys):
    from optimus.cli import main

    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PALS_RANKID", "0")
    monkeypatch.delenv("PMI_SIZE", raising=False)
    assert main(["train", "train.steps=1"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == "optimus: error: PALS_RANKID is set but PMI_SIZE is not: set PMI_SIZE to the number of ranks."


def test_mpich_hydra_single_host():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}
    assert discover(env) == RankInfo(3, 3, 4, 4, "127.0.0.1", 29500, "mpi")
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "1"}  # no local size: one host
    assert discover(env) == RankInfo(1, 1, 2, 2, "127.0.0.1", 29500, "mpi")


def test_mpich_multi_host_needs_master_addr():
    env = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        discover(env)
    env["MASTER_ADDR"] = "head"
    assert discover(env) == RankInfo(5, 1, 8, 4, "head", 29500, "mpi")


def test_openmpi():
    env = {
        "OMPI_COMM_WORLD_RANK": "6",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "29600",
    }
    assert discover(env) == RankInfo(6, 2, 8, 4, "n0", 29600, "mpi")


def test_torchrun_wins_over_an_enclosing_slurm_job():
    env = slurm_env(SLURM_NTASKS_PER_NODE="1", SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0")
    env.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="x", MASTER_PORT="1")
    assert discover(env).launcher == "torchrun"


def test_inconsistent_counts_are_reported():
    with pytest.raises(LaunchError, match="outside world"):
        discover({"RANK": "4", "WORLD_SIZE": "4"})


# ---------------------------------------------------------------------------------------------
# Real processes


def _all_reduce_rank(scale: float) -> tuple[int, int, str, list[float]]:
    info = discover()
    init_process_group(info, "gloo", torch.device("cpu"), timeout_s=30)
    t = torch.tensor([scale * (info.rank + 1), 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return info.rank, info.world_size, info.launcher, t.tolist()


def _fail_on_rank_zero() -> int:
    if int(os.environ["RANK"]) == 0:
        raise ValueError("rank zero refuses")
    return 0


def test_spawn_local_runs_gloo_all_reduce():
    results = spawn_local(2, _all_reduce_rank, (10.0,))
    # sum over ranks of 10*(r+1) = 10 + 20; second entry counts ranks
    assert results == {0: (0, 2, "torchrun", [30.0, 2.0]), 1: (1, 2, "torchrun", [30.0, 2.0])}


def test_spawn_local_surfaces_the_child_exception():
    with pytest.raises(SpawnError, match="rank 0.*ValueError: rank zero refuses"):
        spawn_local(1, _fail_on_rank_zero)  # one process keeps it cheap; the path is the same for N


def _what_the_rank_sees() -> tuple:
    launch = os.environ.get("OPTIMUS_TEST_LAUNCH")
    return launch, "OPTIMUS_TEST_UNSET" in os.environ, os.getcwd(), torch.get_num_threads()


def test_each_launch_gives_its_ranks_the_launchers_environment_and_directory_of_that_moment(tmp_path, monkeypatch):
    """The ranks are forked from a server started at an earlier launch: what the launcher set, unset or changed
    since (environment, working directory, OMP_NUM_THREADS) is what each rank sees, not the server's."""
    monkeypatch.setenv("OPTIMUS_TEST_LAUNCH", "first")
    monkeypatch.setenv("OPTIMUS_TEST_UNSET", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert spawn_local(1, _what_the_rank_sees)[0][:2] == ("first", True)  # the server runs from here on
    (tmp_path / "later").mkdir()
    monkeypatch.chdir(tmp_path / "later")
    monkeypatch.setenv("OPTIMUS_TEST_LAUNCH", "second")
    monkeypatch.delenv("OPTIMUS_TEST_UNSET")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    expected = ("second", False, str(tmp_path / "later"), 1)
    assert spawn_local(2, _what_the_rank_sees) == {0: expected, 1: expected}


def _refuse_on_rank_one() -> int:
    """Rank 1 meets a user error; rank 0 waits in a collective it will never complete."""
    from optimus.local_launcher import report_user_error

    info = discover()
    init_process_group(info, "gloo", torch.device("cpu"), timeout_s=300)
    if info.rank == 1:
        report_user_error("data.path: x does not exist: check the path.")
        raise SystemExit(2)
    dist.barrier()
    return 0


def test_a_rank_user_error_is_one_sentence_and_ends_the_stuck_ranks(tmp_path, monkeypatch):
    """The waiting rank is ended after a short grace, not after its 300 s collective timeout."""
    import tempfile

    from optimus.config import ConfigError

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    with pytest.raises(ConfigError, match=r"^data.path: x does not exist: check the path.$"):
        spawn_local(2, _refuse_on_rank_one)
    with pytest.raises(SpawnError, match="rank 0.*ValueError: rank zero refuses"):
        spawn_local(1, _fail_on_rank_zero)
    assert not list(tmp_path.iterdir())  # no torchelastic_* or other trees left after failed runs


def _wait_for_a_stop_signal() -> str:
    """A rank that only waits for a stop signal (as the trainer does between steps) and returns its name."""
    import time
    from pathlib import Path

    from optimus.train.faults import StopSignal

    stop = StopSignal()
    stop.install()
    Path(os.environ["OPTIMUS_TEST_READY"]).write_text("ready")
    deadline = time.monotonic() + 60
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(0.01)
    Path(os.environ["OPTIMUS_TEST_READY"] + ".received").write_text(str(stop.received))
    return stop.received


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGINT"])
def test_spawn_local_passes_stop_signals_on_to_the_ranks(tmp_path, monkeypatch, sig):
    """What a batch system (SIGUSR1 before the walltime) or Ctrl-C sends to the launching process reaches
    the ranks, which end normally: their results say that they stopped (the trainer's, where it saved), and
    the launcher adds nothing."""
    import signal
    import threading
    import time

    ready = tmp_path / "ready"
    monkeypatch.setenv("OPTIMUS_TEST_READY", str(ready))

    def signal_once_ready():
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), getattr(signal, sig))

    sender = threading.Thread(target=signal_once_ready)
    sender.start()
    try:
        assert spawn_local(1, _wait_for_a_stop_signal) == {0: sig}
    finally:
        sender.join()
    assert (tmp_path / "ready.received").read_text() == sig  # the rank itself got it


def _blocked_signals(pid: int) -> int:
    """The signal mask of process `pid`'s main thread, as a bit set (bit n-1: signal n)."""
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("SigBlk:")).split()[1], 16)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads a process's signal mask from /proc")
@pytest.mark.parametrize("with_another_thread", [False, True])
def test_ctrl_c_held_keeps_a_ctrl_c_from_helpers_but_not_from_this_process(with_another_thread):
    """A helper started in the block begins with SIGINT blocked; a Ctrl-C that reaches this process in the block
    (taken by another thread, or waiting for the mask) is raised once the block is over, not lost."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from optimus.processes import ctrl_c_held

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)  # a thread that does not block SIGINT
    if with_another_thread:
        other.start()
    helper, reached = None, []
    try:
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c_held():
                helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # a Ctrl-C the block did not hold would be raised here
                reached.append("end of the block")
            reached.append("after the block")
        assert reached == ["end of the block"]  # the KeyboardInterrupt came as the block ended
        assert _blocked_signals(helper.pid) & (1 << (signal.SIGINT - 1))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # this process's handler is back
        assert not _blocked_signals(os.getpid()) & (1 << (signal.SIGINT - 1))
    finally:
        stop.set()
        if helper is not None:
            helper.kill()
            helper.wait()
