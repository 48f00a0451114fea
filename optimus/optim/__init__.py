"""The EP-aware sharded optimizer (a gradient sharder and an update rule), gradient clipping and LR schedules."""

from optimus.config import SHARDING_SCHEMES, WEIGHT_PASS_SCHEDULES, OptimusConfig
from optimus.kernels.torch_private import found
from optimus.optim.memory import StateBytes, rank_state_bytes
from optimus.optim.protocol import Optimizer
from optimus.optim.schedule import lr_at
from optimus.optim.sharded import ShardedAdamW, ShardedMuon, ShardedOptimizer
from optimus.optim.sharder import GradSharder
from optimus.parallel import ParallelState

SCHEMES = SHARDING_SCHEMES  # the values of optim.sharding that name a scheme (all but auto)


def resolve_sharding(sharding: str, world_size: int) -> str:
    """`auto` means ep_aware on several ranks and none on one."""
    if sharding == "auto":
        return "ep_aware" if world_size > 1 else "none"
    return sharding


def weight_pass_sinks(zero: int) -> bool:
    """Whether kernels may add weight gradients into the optimizer's sums under a schedule with a weight pass of its
    own (zero bubble): with ZeRO-2, whose gradient hook fires in that pass and drops the placeholders it assigns
    to .grad, where this torch lets a kernel tell the input pass (which must add nothing) from the weight pass
    (optimus.kernels.torch_private.needed_input_grads). ZeRO-1 learns of a weight pass's gradients only from
    .grad after the backwards, where a placeholder cannot be told from a gradient."""
    return zero == 2 and found("will_engine_execute_node")


def build_optimizer(
    model, cfg: OptimusConfig, ps: ParallelState, timers=None, micro_batches: int = 1, tied=None
) -> Optimizer:
    """The optimizer `cfg` describes (optim.sharding resolved) over a stage's ranks `ps`: it averages, clips and
    applies the gradients of `micro_batches` backwards in `step(lr)`."""
    sharding = resolve_sharding(cfg.optim.sharding, ps.world_size)
    rule = ShardedMuon if cfg.optim.update == "muon" else ShardedAdamW
    grad_sinks = cfg.parallel.pp_schedule not in WEIGHT_PASS_SCHEDULES or weight_pass_sinks(cfg.optim.zero)
    return rule(model, cfg.optim, ps, cfg.train.grad_clip, sharding, timers, micro_batches, tied, grad_sinks)


__all__ = [
    "SCHEMES", "GradSharder", "Optimizer", "ShardedAdamW", "ShardedMuon", "ShardedOptimizer", "StateBytes",
    "build_optimizer", "lr_at", "rank_state_bytes", "resolve_sharding",
]  # fmt: skip
