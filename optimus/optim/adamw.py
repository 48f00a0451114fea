"""AdamW on flat fp32 shards, step for step the arithmetic of torch.optim.AdamW (single-tensor path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimus.optim.flat_buffer import Segment

UPDATE_CHUNK = 2**20  # elements updated at a time (4 MiB fp32 temporaries)


@dataclass
class AdamWHyper:
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@torch.no_grad()
def adamw_update(
    segments: list[Segment],
    param_N: torch.Tensor,  # fp32 slice being updated (master copy, or the fp32 parameters themselves)
    grad_N: torch.Tensor,  # summed gradient shard, in the parameter dtype
    exp_avg_N: torch.Tensor,
    exp_avg_sq_N: torch.Tensor,
    lr: float,
    step: int,
    h: AdamWHyper,
    grad_scale: float,  # 1 / world x clip factor, applied in fp32
) -> None:
    """One decoupled-weight-decay Adam step on each segment (decay only where the segment says so).

    The gradient is scaled in fp32 (in place when it is fp32: it is used once).
    """
    bias_correction1 = 1 - h.beta1**step
    bias_correction2_sqrt = (1 - h.beta2**step) ** 0.5
    step_size = lr / bias_correction1
    # In chunks: the update's temporaries (sqrt, denominator) would otherwise be as large as a segment,
    # which can hold all of a rank's expert weights (two extra fp32 copies at the step's peak).
    chunks = (
        (lo, min(lo + UPDATE_CHUNK, seg.hi), seg) for seg in segments for lo in range(seg.lo, seg.hi, UPDATE_CHUNK)
    )
    for lo, hi, seg in chunks:
        p, g = param_N[lo:hi], grad_N[lo:hi].float().mul_(grad_scale)
        m, v = exp_avg_N[lo:hi], exp_avg_sq_N[lo:hi]
        p.mul_(1 - lr * (h.weight_decay if seg.weight_decay else 0.0))
        m.lerp_(g, 1 - h.beta1)
        v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(h.eps)
        p.addcdiv_(m, denom, value=-step_size)
