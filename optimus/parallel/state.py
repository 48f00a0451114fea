"""The parallel layout: world = PP x DP x EP with PP outermost, EP innermost, and the process groups of each.

Rank r sits at pipeline stage pp_rank = r // S, where S = world / pp ranks hold each
stage, and inside its stage at (dp_rank, ep_rank) = divmod(r % S, ep). The EP group
(ranks that hold different experts and exchange tokens) is a run of `ep` consecutive
ranks, so it stays inside a node; the expert-data-parallel group (ranks of one stage
holding the same experts) strides by `ep`; the pipeline group (the ranks at the same
place in every stage, which pass activations along) strides by S, so stages span nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from optimus.config import ConfigError, validate_layout


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    ep: int = 1
    world_group: Any = None  # None = default group (or no distributed at all)
    ep_group: Any = None
    edp_group: Any = None
    pp: int = 1
    stage_group: Any = None  # pp > 1: this stage's DP x EP ranks
    # pp > 1: the ranks at this rank's place in every stage. A stage view (`stage()`) keeps it, with pp = 1,
    # so that what sums over a whole model (the gradient norm) also sums over the other stages.
    pp_group: Any = None

    @property
    def stage_size(self) -> int:
        return self.world_size // self.pp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.stage_size

    @property
    def dp(self) -> int:
        return self.stage_size // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def dp_rank(self) -> int:
        return (self.rank % self.stage_size) // self.ep

    def stage(self) -> ParallelState:
        """This rank's pipeline stage seen as a world of its own (rank, size and group of the stage's DP x EP
        ranks): what the optimizer, the data loader and expert parallelism work in. Itself when pp = 1."""
        if self.pp == 1:
            return self
        return ParallelState(
            rank=self.rank % self.stage_size,
            world_size=self.stage_size,
            ep=self.ep,
            world_group=self.stage_group,
            ep_group=self.ep_group,
            edp_group=self.edp_group,
            pp_group=self.pp_group,
        )

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ep_group_ranks(world_size: int, ep: int) -> list[list[int]]:
    return [list(range(start, start + ep)) for start in range(0, world_size, ep)]


def edp_group_ranks(world_size: int, ep: int, pp: int = 1) -> list[list[int]]:
    stage_size = world_size // pp
    return [
        list(range(start + ep_rank, start + stage_size, ep))
        for start in range(0, world_size, stage_size)
        for ep_rank in range(ep)
    ]


def stage_group_ranks(world_size: int, pp: int) -> list[list[int]]:
    stage_size = world_size // pp
    return [list(range(start, start + stage_size)) for start in range(0, world_size, stage_size)]


def pp_group_ranks(world_size: int, pp: int) -> list[list[int]]:
    stage_size = world_size // pp
    return [list(range(local, world_size, stage_size)) for local in range(stage_size)]


def build_parallel_state(ep: int, timeout_s: float | None = None, pp: int = 1) -> ParallelState:
    """Create the EP and EDP groups (and with pp > 1 the stage and pipeline groups) on an initialised default
    process group (or a single process).

    `timeout_s` (parallel.timeout_s) bounds every collective on the new groups; new_group would
    otherwise use the backend's default (30 minutes), not the default group's timeout.
    """
    if not dist.is_initialized():
        if ep != 1 or pp != 1:
            key = "parallel.ep" if ep != 1 else "parallel.pp"
            raise ConfigError(
                f"{key}={ep if ep != 1 else pp} needs several processes: "
                "set parallel.nproc or launch with torchrun/srun/mpiexec."
            )
        return ParallelState()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    validate_layout(world_size, ep, pp)
    state = ParallelState(rank=rank, world_size=world_size, ep=ep, world_group=dist.group.WORLD, pp=pp)
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    # Every rank must call new_group for every group, in the same order.
    layouts = [("ep_group", ep_group_ranks(world_size, ep)), ("edp_group", edp_group_ranks(world_size, ep, pp))]
    if pp > 1:
        layouts += [("stage_group", stage_group_ranks(world_size, pp)), ("pp_group", pp_group_ranks(world_size, pp))]
    for field, groups in layouts:
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                setattr(state, field, group)
    return state
