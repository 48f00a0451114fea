"""Which rank this process is, from the environment its launcher left behind, and joining the process group.

`discover()` reads the environment a launcher leaves behind (torchrun, SLURM's srun, PBS/PALS
mpiexec on Aurora, MPICH hydra or Open MPI) and returns one `RankInfo`; `init_process_group()`
turns it into a torch.distributed process group. The ranks that `parallel.nproc=N` starts on one
machine (optimus.local_launcher) are handed torchrun's environment, so they are found the same way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

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
