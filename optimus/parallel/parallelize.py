"""Applying the parallel layout to a model from outside."""

from __future__ import annotations

import torch.nn as nn

from optimus.config import ParallelConfig
from optimus.parallel.state import ParallelState


def parallelize_model(model: nn.Module, ps: ParallelState, cfg: ParallelConfig) -> nn.Module:
    """Shard experts over the EP group and install the EP dispatcher; a no-op for EP = 1."""
    if ps.ep == 1:
        return model
    from optimus.parallel.expert_parallel import apply_expert_parallel

    return apply_expert_parallel(model, ps, cfg)
