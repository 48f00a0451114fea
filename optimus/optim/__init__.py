"""Optimizers (replicated and EP-aware sharded AdamW), gradient clipping and LR schedules."""

from optimus.config import ConfigError, OptimusConfig
from optimus.optim.replicated import ReplicatedAdamW
from optimus.optim.schedule import lr_at
from optimus.optim.sharded import ShardedAdamW
from optimus.parallel import ParallelState


def resolve_sharding(sharding: str, world_size: int) -> str:
    """`auto` means ep_aware on several ranks and none on one."""
    if sharding == "auto":
        return "ep_aware" if world_size > 1 else "none"
    return sharding


def build_optimizer(model, cfg: OptimusConfig, ps: ParallelState):
    """The optimizer for `optim.sharding`; each one averages, clips and applies gradients in `step(lr)`."""
    sharding = resolve_sharding(cfg.optim.sharding, ps.world_size)
    if sharding == "none":
        return ReplicatedAdamW(model, cfg.optim, ps, cfg.train.grad_clip)
    if sharding in ("ep_aware", "standard"):
        return ShardedAdamW(model, cfg.optim, ps, cfg.train.grad_clip, sharding)
    raise ConfigError(f"optim.sharding={sharding!r} is not supported: set it to auto, ep_aware, standard or none.")


__all__ = ["ReplicatedAdamW", "ShardedAdamW", "build_optimizer", "lr_at", "resolve_sharding"]
