"""The EP-aware AdamW (replicated or sharded state), gradient clipping and LR schedules."""

from optimus.config import OptimusConfig, check_choice
from optimus.optim.protocol import Optimizer
from optimus.optim.schedule import lr_at
from optimus.optim.sharded import SCHEMES, ShardedAdamW, StateBytes, rank_state_bytes
from optimus.parallel import ParallelState


def resolve_sharding(sharding: str, world_size: int) -> str:
    """`auto` means ep_aware on several ranks and none on one."""
    if sharding == "auto":
        return "ep_aware" if world_size > 1 else "none"
    return sharding


def build_optimizer(model, cfg: OptimusConfig, ps: ParallelState, timers=None) -> Optimizer:
    """The optimizer for `optim.sharding`: it averages, clips and applies gradients in `step(lr)`."""
    check_choice(cfg.optim.sharding, "optim.sharding", ("auto", *SCHEMES))
    sharding = resolve_sharding(cfg.optim.sharding, ps.world_size)
    return ShardedAdamW(model, cfg.optim, ps, cfg.train.grad_clip, sharding, timers)


__all__ = [
    "SCHEMES", "Optimizer", "ShardedAdamW", "StateBytes", "build_optimizer", "lr_at", "rank_state_bytes",
    "resolve_sharding",
]  # fmt: skip
