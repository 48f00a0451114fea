"""The parallel layout: world = DP x EP with EP innermost, and the process groups of each.

Rank r sits at (dp_rank, ep_rank) = divmod(r, ep). The EP group (ranks that hold
different experts and exchange tokens) is a run of `ep` consecutive ranks, so it
stays inside a node; the expert-data-parallel group (ranks holding the same
experts) strides by `ep`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from optimus.config import ConfigError


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    ep: int = 1
    world_group: Any = None  # None = default group (or no distributed at all)
    ep_group: Any = None
    edp_group: Any = None

    @property
    def dp(self) -> int:
        return self.world_size // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ep

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ep_group_ranks(world_size: int, ep: int) -> list[list[int]]:
    return [list(range(start, start + ep)) for start in range(0, world_size, ep)]


def edp_group_ranks(world_size: int, ep: int) -> list[list[int]]:
    return [list(range(ep_rank, world_size, ep)) for ep_rank in range(ep)]


def build_parallel_state(ep: int, timeout_s: float | None = None) -> ParallelState:
    """Create the EP and EDP groups on an initialised default process group (or a single process).

    `timeout_s` (parallel.timeout_s) bounds every collective on the new groups; new_group would
    otherwise use the backend's default (30 minutes), not the default group's timeout.
    """
    if not dist.is_initialized():
        if ep != 1:
            raise ConfigError(
                f"parallel.ep={ep} needs several processes: set parallel.nproc or launch with torchrun/srun/mpiexec."
            )
        return ParallelState()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide the world size {world_size}: choose an ep that divides it."
        )
    state = ParallelState(rank=rank, world_size=world_size, ep=ep, world_group=dist.group.WORLD)
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    # Every rank must call new_group for every group, in the same order.
    for ranks in ep_group_ranks(world_size, ep):
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            state.ep_group = group
    for ranks in edp_group_ranks(world_size, ep):
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            state.edp_group = group
    return state
