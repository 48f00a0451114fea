"""The parallel layout: world = PP x DP x TP with PP outermost and TP innermost; MoE layers see the same
ranks as PP x EDP x EP (parallel folding), and the process groups of each.

Rank r sits at pipeline stage pp_rank = r // S, where S = world / pp ranks hold each
stage. Inside its stage, s = r % S, it has two coordinates:

    dense layers (attention, dense FFNs, embedding, head):  (data_rank, tp_rank) = divmod(s, tp)
    MoE layers (routed experts):                            (dp_rank, ep_rank)   = divmod(s, ep)

The TP group (ranks that split each dense weight and share one batch) and the EP group
(ranks that hold different experts and exchange tokens) are runs of consecutive ranks, so
they stay inside a node; with tp > 1 the EP group takes in whole TP groups or part of one,
so the ranks that split attention also split the experts. The dense data-parallel group
(same tp_rank: replicas of the same dense slices) strides by tp, the expert-data-parallel
group (same experts) by ep; the pipeline group (the ranks at the same place in every stage,
which pass activations along) strides by S, so stages span nodes. With tp = 1 the dense
data-parallel group is the whole stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

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
    tp: int = 1
    tp_group: Any = None  # tp > 1: the consecutive ranks that split the dense weights
    tp_mesh: Any = None  # tp > 1: a 1-D DeviceMesh over tp_group (what DTensor parallelises over)
    dense_dp_group: Any = None  # tp > 1: the stage's ranks with this rank's tp_rank (dense replicas)
    sp: bool = False  # tp > 1 with sequence parallelism: the residual stream holds seq_len / tp positions

    def residual_seq_len(self, seq_len: int) -> int:
        """Positions of the residual stream (what blocks and pipeline stages pass on) on this rank."""
        return seq_len // self.tp if self.sp else seq_len

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

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks of a stage that read different batches (the tp ranks of one group share theirs)."""
        return self.stage_size // self.tp

    @property
    def data_rank(self) -> int:
        return (self.rank % self.stage_size) // self.tp

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
            tp=self.tp,
            tp_group=self.tp_group,
            tp_mesh=self.tp_mesh,
            dense_dp_group=self.dense_dp_group,
            sp=self.sp,
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


def tp_group_ranks(world_size: int, tp: int) -> list[list[int]]:
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def dense_dp_group_ranks(world_size: int, tp: int, pp: int = 1) -> list[list[int]]:
    return edp_group_ranks(world_size, tp, pp)  # the same striding, by tp instead of ep


def pp_group_ranks(world_size: int, pp: int) -> list[list[int]]:
    stage_size = world_size // pp
    return [list(range(local, world_size, stage_size)) for local in range(stage_size)]


def build_parallel_state(
    ep: int, timeout_s: float | None = None, pp: int = 1, tp: int = 1, device_type: str = "cpu", sp: bool = True
) -> ParallelState:
    """Create the EP and EDP groups (with pp > 1 the stage and pipeline groups, with tp > 1 the TP group, its
    DeviceMesh and the dense data-parallel group) on an initialised default process group (or a single process).

    `timeout_s` (parallel.timeout_s) bounds every collective on the new groups; new_group would
    otherwise use the backend's default (30 minutes), not the default group's timeout.
    """
    if not dist.is_initialized():
        for key, size in (("parallel.ep", ep), ("parallel.pp", pp), ("parallel.tp", tp)):
            if size != 1:
                raise ConfigError(
                    f"{key}={size} needs several processes: set parallel.nproc or launch with torchrun/srun/mpiexec."
                )
        return ParallelState()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    validate_layout(world_size, ep, pp, tp)
    state = ParallelState(
        rank=rank, world_size=world_size, ep=ep, world_group=dist.group.WORLD, pp=pp, tp=tp, sp=sp and tp > 1
    )
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    # Every rank must call new_group for every group, in the same order.
    layouts = [("ep_group", ep_group_ranks(world_size, ep)), ("edp_group", edp_group_ranks(world_size, ep, pp))]
    if pp > 1:
        layouts += [("stage_group", stage_group_ranks(world_size, pp)), ("pp_group", pp_group_ranks(world_size, pp))]
    if tp > 1:
        layouts += [("tp_group", tp_group_ranks(world_size, tp))]
        layouts += [("dense_dp_group", dense_dp_group_ranks(world_size, tp, pp))]
    for field, groups in layouts:
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                setattr(state, field, group)
                if field == "tp_group":
                    state.tp_mesh = DeviceMesh.from_group(group, device_type, mesh=ranks, mesh_dim_names=("tp",))
    return state
