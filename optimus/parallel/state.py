"""A rank's place in the run's Layout (optimus/layout.py: the arithmetic and the naming) and the process
groups it belongs to: DP, TP, EP, EDP and PP, created once on the default group (`build_parallel_state`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from optimus.config import ConfigError
from optimus.layout import Layout


@dataclass
class ParallelState:
    rank: int = 0
    layout: Layout = field(default_factory=Layout)
    world_group: Any = None  # None = default group (or no distributed at all)
    ep_group: Any = None
    edp_group: Any = None
    stage_group: Any = None  # pp > 1: this stage's DP x TP (= EDP x EP) ranks
    # pp > 1: the ranks at this rank's place in every stage. A stage view (`stage()`) keeps it, with pp = 1,
    # so that what sums over a whole model (the gradient norm) also sums over the other stages.
    pp_group: Any = None
    tp_group: Any = None  # tp > 1: the consecutive ranks that split the dense weights
    tp_mesh: Any = None  # tp > 1: a 1-D DeviceMesh over tp_group (what DTensor parallelises over)
    dense_dp_group: Any = None  # tp > 1: the stage's ranks with this rank's tp_rank (dense replicas)
    # optim.shard_ranks set: this rank's shard group (S consecutive members, which split the optimizer state) and
    # replica group (the members holding the same shard) of its data-parallel group (the stage with tp = 1) and of
    # its expert-data-parallel group (optimus.layout: shard_groups, replica_groups); None where of one rank.
    dp_shard_group: Any = None
    dp_replica_group: Any = None
    edp_shard_group: Any = None
    edp_replica_group: Any = None

    # The layout's degrees, and this rank's coordinates in it.
    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def sp(self) -> bool:
        return self.layout.sp

    @property
    def stage_size(self) -> int:
        return self.layout.stage_size

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks of a stage that read different batches."""
        return self.layout.dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: ranks of a stage that hold the same experts."""
        return self.layout.edp

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.layout.ep_rank(self.rank)

    @property
    def edp_rank(self) -> int:
        return self.layout.edp_rank(self.rank)

    def residual_seq_len(self, seq_len: int) -> int:
        """Positions of the residual stream (what blocks and pipeline stages pass on) on this rank."""
        return self.layout.residual_seq_len(seq_len)

    def stage(self) -> ParallelState:
        """This rank's pipeline stage seen as a world of its own (rank, layout and group of the stage's ranks):
        what the optimizer, the data loader and expert parallelism work in. Itself when pp = 1."""
        if self.pp == 1:
            return self
        return ParallelState(
            rank=self.rank % self.stage_size,
            layout=self.layout.one_stage(),
            world_group=self.stage_group,
            ep_group=self.ep_group,
            edp_group=self.edp_group,
            pp_group=self.pp_group,
            tp_group=self.tp_group,
            tp_mesh=self.tp_mesh,
            dense_dp_group=self.dense_dp_group,
            dp_shard_group=self.dp_shard_group,
            dp_replica_group=self.dp_replica_group,
            edp_shard_group=self.edp_shard_group,
            edp_replica_group=self.edp_replica_group,
        )

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def build_parallel_state(
    ep: int, timeout_s: float | None = None, pp: int = 1, tp: int = 1, device_type: str = "cpu", sp: bool = True,
    pp_virtual: int = 1, shard_ranks: int | None = None,
) -> ParallelState:  # fmt: skip
    """Create the EP and EDP groups (with pp > 1 the stage and pipeline groups, with tp > 1 the TP group, its
    DeviceMesh and the dense data-parallel group, with `shard_ranks` (optim.shard_ranks) the shard and replica
    groups of hierarchical sharding) on an initialised default process group (or a single process).

    `timeout_s` (parallel.timeout_s) bounds every collective on the new groups; new_group would
    otherwise use the backend's default (30 minutes), not the default group's timeout.
    """
    if not dist.is_initialized():
        for key, size in (("parallel.ep", ep), ("parallel.pp", pp), ("parallel.tp", tp)):
            if size != 1:
                raise ConfigError(
                    f"{key}={size} needs several processes: set parallel.nproc or launch with torchrun/srun/mpiexec."
                )
        return ParallelState(layout=Layout(shard_ranks=shard_ranks))
    rank = dist.get_rank()
    layout = Layout(dist.get_world_size(), pp, tp, ep, sp, pp_virtual, shard_ranks)  # refuses what does not divide
    state = ParallelState(rank=rank, layout=layout, world_group=dist.group.WORLD)
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    # Every rank must call new_group for every group, in the same order.
    kinds = [("ep_group", layout.ep_groups()), ("edp_group", layout.edp_groups())]
    if pp > 1:
        kinds += [("stage_group", layout.stage_groups()), ("pp_group", layout.pp_groups())]
    if tp > 1:
        kinds += [("tp_group", layout.tp_groups()), ("dense_dp_group", layout.dp_groups())]
    if shard_ranks is not None:  # a shard or replica group of one rank is none: nothing to reduce or gather there
        for prefix, worlds in (("dp", layout.dp_groups()), ("edp", layout.edp_groups())):
            for kind, groups in (("shard", layout.shard_groups(worlds)), ("replica", layout.replica_groups(worlds))):
                kinds += [(f"{prefix}_{kind}_group", groups)] if len(groups[0]) > 1 else []
    for group_field, groups in kinds:
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                setattr(state, group_field, group)
                if group_field == "tp_group":
                    state.tp_mesh = DeviceMesh.from_group(group, device_type, mesh=ranks, mesh_dim_names=("tp",))
    return state
