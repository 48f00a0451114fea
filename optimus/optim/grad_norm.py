"""Global gradient norm over sharded gradients, and the clip factor shared by every parameter group."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def global_grad_norm(owned_sq_sums: list[torch.Tensor], world_group, distributed: bool) -> float:
    """sqrt of the sum of squares of every rank's owned gradient shards.

    Each element of the model must be counted by exactly one rank: callers pass a
    zero for shards that other ranks also hold (the `standard` scheme's dense shards).
    """
    total = torch.stack([s.float() for s in owned_sq_sums]).sum() if owned_sq_sums else torch.zeros(())
    if distributed:
        dist.all_reduce(total, group=world_group)
    return math.sqrt(total.item())


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor clip_grad_norm_ applies: max_norm / (norm + 1e-6), at most 1; 1 when clipping is off."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
