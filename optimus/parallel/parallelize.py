"""Applying the parallel layout to a model from outside."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from optimus.config import ParallelConfig
from optimus.model.moe.router import Router
from optimus.parallel.state import ParallelState


def install_balance_group(model: nn.Module, ps: ParallelState) -> None:
    """Routers with aux_loss_scope=global count expert choices over every data-parallel rank (the world)."""
    if not ps.is_distributed:
        return
    for module in model.modules():
        if isinstance(module, Router) and module.aux_loss_scope == "global":
            module.balance_group = ps.world_group or dist.group.WORLD


def parallelize_model(
    model: nn.Module, ps: ParallelState, cfg: ParallelConfig, equal_tokens: bool = False
) -> nn.Module:
    """Shard experts over the EP group and install the EP dispatcher (a no-op for EP = 1); hand global
    load balancing its process group. `equal_tokens`: see apply_expert_parallel."""
    install_balance_group(model, ps)
    if ps.ep == 1:
        return model
    from optimus.parallel.expert_parallel import apply_expert_parallel

    return apply_expert_parallel(model, ps, cfg, equal_tokens)
