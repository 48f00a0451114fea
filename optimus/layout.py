"""The rank layout of a run: world = pp x dp x tp, with PP outermost and TP innermost; MoE layers see each
pipeline stage's dp x tp ranks as edp x ep instead (parallel folding).

Rank r sits at pipeline stage pp_rank = r // S, where S = world / pp ranks hold each stage. Inside its
stage, s = r % S, it has two coordinates:

    dense layers (attention, dense FFNs, embedding, head):  (dp_rank, tp_rank)  = divmod(s, tp)
    MoE layers (routed experts):                            (edp_rank, ep_rank) = divmod(s, ep)

The TP group (ranks that split each dense weight and share one batch) and the EP group (ranks that hold
different experts and exchange tokens) are runs of consecutive ranks, so they stay inside a node; with
tp > 1 the EP group takes in whole TP groups or part of one, so the ranks that split attention also split
the experts. The data-parallel group (same tp_rank: replicas of the same dense slices) strides by tp, the
expert-data-parallel group (same experts) by ep; the pipeline group (the ranks at the same place in every
stage, which pass activations along) strides by S, so stages span nodes. With tp = 1 the data-parallel
group is the whole stage.

Hierarchical sharding (optim.shard_ranks = R): the optimizer splits its state over the data-parallel and the
expert-data-parallel groups; with R set, each such group is cut into shard groups of R consecutive members
(position // R: with tp = 1 the dense group's are consecutive ranks, the experts' ranks ep apart), which split
the state, and replica groups (position % R), whose members hold the same shard.

`Layout` holds these numbers, checked once when it is made; the planner, the dry run, the predictor, the
optimizer's memory arithmetic, the run records and the trainer read them from it (ParallelState is a Layout
plus this rank and its process groups). Names say what they hold everywhere: `dp` is the data-parallel
degree (ranks that read different batches), `edp` the expert-data-parallel degree (replicas of one expert).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimus.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    world: int = 1  # ranks of the run
    pp: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel degree (innermost)
    ep: int = 1  # expert-parallel degree (MoE layers; innermost too)
    sp: bool = False  # sequence parallelism: with tp > 1 the residual stream holds seq_len / tp positions
    pp_virtual: int = 1  # stages per rank (interleaved schedules)
    # optim.shard_ranks: ranks that split each optimizer group's state, consecutive in the group's rank order; the
    # group's other ranks hold replicas of the same shards (hierarchical sharding). None: all of the group's ranks.
    shard_ranks: int | None = None

    def __post_init__(self):
        for key, size in (("parallel.pp", self.pp), ("parallel.tp", self.tp), ("parallel.ep", self.ep)):
            if not 0 < size < float("inf"):  # also refuses nan and inf
                raise ConfigError(f"{key}={size} must be a positive, finite number.")
        if self.world % self.pp:
            raise ConfigError(
                f"parallel.pp={self.pp} does not divide the world size {self.world}: choose a pp that divides it."
            )
        where = f"the world size {self.world}" if self.pp == 1 else f"the {self.stage_size} ranks of a pipeline stage"
        for key, size in (("parallel.tp", self.tp), ("parallel.ep", self.ep)):
            if self.stage_size % size:
                raise ConfigError(f"{key}={size} does not divide {where}: choose a {key[9:]} that divides it.")
        if self.sp and self.tp == 1:
            object.__setattr__(self, "sp", False)  # nothing to split the sequence over
        self._check_shard_ranks()

    def _check_shard_ranks(self) -> None:
        """optim.shard_ranks must cut both optimizer groups' ranks (dp and edp: every sharded scheme splits its
        dense state over one of them and its expert state over edp) into whole groups."""
        s = self.shard_ranks
        if s is None:
            return
        if not (isinstance(s, int) and s >= 1):
            raise ConfigError(
                f"optim.shard_ranks={s} must be a positive whole number, or null (all of a group's ranks)."
            )
        if self.dp % s or self.edp % s:
            raise ConfigError(
                f"optim.shard_ranks={s} does not divide the {self.dp} data-parallel and {self.edp} "
                f"expert-data-parallel ranks of a pipeline stage: choose a shard_ranks that divides "
                f"{math.gcd(self.dp, self.edp)}, or null."
            )

    @property
    def stage_size(self) -> int:
        """Ranks that hold one pipeline stage."""
        return self.world // self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks of a stage that read different batches (a TP group shares one)."""
        return self.stage_size // self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: ranks of a stage that hold the same experts."""
        return self.stage_size // self.ep

    def one_stage(self) -> Layout:
        """A pipeline stage seen as a run of its own (what the optimizer, the data loader and expert
        parallelism work in): itself when pp = 1."""
        if self.pp == 1:
            return self
        return Layout(world=self.stage_size, tp=self.tp, ep=self.ep, sp=self.sp, shard_ranks=self.shard_ranks)

    def residual_seq_len(self, seq_len: int) -> int:
        """Positions of the residual stream (what blocks and pipeline stages pass on) on each rank."""
        return seq_len // self.tp if self.sp else seq_len

    def micro_batches(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches each rank runs per step: global_batch / (micro_batch x dp), refused unless whole."""
        ranks = "data-parallel ranks" if self.pp > 1 else "world size / parallel.tp" if self.tp > 1 else "world size"
        return micro_batches_per_rank(global_batch, micro_batch, self.dp, ranks)

    # A rank's coordinates (see the module's docstring).
    def pp_rank(self, rank: int) -> int:
        return rank // self.stage_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return (rank % self.stage_size) // self.tp

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def edp_rank(self, rank: int) -> int:
        return (rank % self.stage_size) // self.ep

    # The ranks of each process group, every group of a kind (each rank is in exactly one of them).
    def ep_groups(self) -> list[list[int]]:
        return _runs(self.world, self.ep)

    def edp_groups(self) -> list[list[int]]:
        return _strided_in_stages(self.world, self.stage_size, self.ep)

    def tp_groups(self) -> list[list[int]]:
        return _runs(self.world, self.tp)

    def dp_groups(self) -> list[list[int]]:
        return _strided_in_stages(self.world, self.stage_size, self.tp)  # the same striding, by tp instead of ep

    def stage_groups(self) -> list[list[int]]:
        return _runs(self.world, self.stage_size)

    def pp_groups(self) -> list[list[int]]:
        return [list(range(local, self.world, self.stage_size)) for local in range(self.stage_size)]

    # Hierarchical sharding (optim.shard_ranks = S): a group of n ranks that shares an optimizer group's state (its
    # shard world: the data-parallel group, the stage's ranks with tp = 1, or the expert-data-parallel group) is cut
    # into n / S shard groups of S consecutive members, which split the state; the members at the same place in
    # each shard group (its replica group) hold the same shard.
    def shard_size(self, ranks: int) -> int:
        """Ranks that split the state of a group whose shard world is `ranks`: optim.shard_ranks, else all."""
        return ranks if self.shard_ranks is None else self.shard_ranks

    def shard_replicas(self, ranks: int) -> int:
        """Shard groups of a shard world of `ranks`: the copies of each shard."""
        return ranks // self.shard_size(ranks)

    def shard_place(self, position: int, ranks: int) -> tuple[int, int]:
        """(replica, shard rank): which shard group the member at `position` of a shard world of `ranks` is in,
        and its place there."""
        return divmod(position, self.shard_size(ranks))

    def shard_groups(self, worlds: list[list[int]]) -> list[list[int]]:
        """The shard groups of every group of `worlds` (e.g. dp_groups()): consecutive members, S at a time."""
        return [world[i : i + s] for world, s in self._with_shard_size(worlds) for i in range(0, len(world), s)]

    def replica_groups(self, worlds: list[list[int]]) -> list[list[int]]:
        """The replica groups of every group of `worlds`: the members S apart, which hold the same shard."""
        return [world[i::s] for world, s in self._with_shard_size(worlds) for i in range(s)]

    def _with_shard_size(self, worlds: list[list[int]]) -> list[tuple[list[int], int]]:
        return [(world, self.shard_size(len(world))) for world in worlds]


def _runs(world: int, size: int) -> list[list[int]]:
    """Consecutive ranks, `size` at a time."""
    return [list(range(start, start + size)) for start in range(0, world, size)]


def _strided_in_stages(world: int, stage_size: int, stride: int) -> list[list[int]]:
    """In each stage, the ranks `stride` apart: those at the same place in each run of `stride`."""
    return [
        list(range(start + offset, start + stage_size, stride))
        for start in range(0, world, stage_size)
        for offset in range(stride)
    ]


def micro_batches_per_rank(global_batch: int, micro_batch: int, data_parallel: int, ranks: str = "world size") -> int:
    """global_batch / (micro_batch x data_parallel), refused unless whole; `ranks` names data_parallel to the user."""
    if not 0 < micro_batch < float("inf"):  # also refuses nan and inf
        raise ConfigError(f"train.micro_batch={micro_batch} must be a positive, finite number.")
    if global_batch % (micro_batch * data_parallel):
        raise ConfigError(
            f"train.global_batch={global_batch} is not divisible by train.micro_batch x {ranks} = "
            f"{micro_batch} x {data_parallel}: make global_batch a multiple of {micro_batch * data_parallel}."
        )
    return global_batch // (micro_batch * data_parallel)


def experts_per_rank(n_experts: int, ep: int) -> int:
    """E / ep, the routed experts each EP rank holds; refused when ep does not split them evenly."""
    if ep > 1 and n_experts == 0:
        raise ConfigError("parallel.ep > 1 needs a model with experts: set parallel.ep=1 for a dense model.")
    if n_experts % ep:
        raise ConfigError(
            f"model.moe.n_experts={n_experts} is not divisible by parallel.ep={ep}: "
            "choose an ep that divides the number of experts."
        )
    return n_experts // ep


def expert_range(n_experts: int, ep: int, ep_rank: int) -> tuple[int, int]:
    """Global indices [start, end) of the experts EP rank `ep_rank` holds: contiguous blocks of E / ep."""
    n_local = experts_per_rank(n_experts, ep)
    return ep_rank * n_local, (ep_rank + 1) * n_local
