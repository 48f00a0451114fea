"""`optim.sharding=none`: every rank keeps the full AdamW state (torch's AdamW).

Gradients are averaged so that the update equals one over the mean loss of the
global batch: dense gradients are summed over the world, expert gradients over
the expert-data-parallel group (each expert already received the gradients of
every EP peer's tokens through the dispatcher's backward), then both are
divided by the world size.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.distributed as dist

from optimus.config import OptimConfig
from optimus.model.counts import is_expert_param
from optimus.parallel import ParallelState


def param_groups(named_params: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never norms or biases (1-D parameters)."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class ReplicatedAdamW:
    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, ps: ParallelState, grad_clip: float):
        self.ps = ps
        self.grad_clip = grad_clip
        self.timers = None  # profile.timers: the trainer hands in its optimus.train.timers.Timers
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.dense_params = [p for n, p in named if not is_expert_param(n)]
        self.expert_params = [p for n, p in named if is_expert_param(n)]
        self.optimizer = torch.optim.AdamW(
            param_groups(named, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
        )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_last_micro_batch(self, is_last: bool) -> None:
        """Gradients are reduced in step(), so which micro-batch comes last does not matter here."""

    def _average_grads(self) -> None:
        ps = self.ps
        for params, group in ((self.dense_params, ps.world_group), (self.expert_params, ps.edp_group)):
            if not params:
                continue
            # A parameter unused on this rank still joins the all-reduce (as zeros): sizes must match across ranks.
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            flat /= ps.world_size
            for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(chunk.view_as(g))

    def grad_norm(self) -> float:
        """Global L2 norm: dense grads are replicated; each EP rank holds different experts."""
        device = (self.dense_params or self.expert_params)[0].device
        dense_sq = sum(
            (p.grad.float().square().sum() for p in self.dense_params if p.grad is not None),
            torch.zeros((), device=device),
        )
        expert_sq = sum(
            (p.grad.float().square().sum() for p in self.expert_params if p.grad is not None),
            torch.zeros((), device=device),
        )
        if self.ps.ep > 1:
            dist.all_reduce(expert_sq, group=self.ps.ep_group)
        return math.sqrt((dense_sq + expert_sq).item())

    def step(self, lr: float) -> float:
        """Average, clip and apply the gradients; returns the pre-clip norm (no update if it is not finite)."""
        if self.ps.is_distributed:
            with self.timers("grad_reduce") if self.timers else nullcontext():  # profile.timers
                self._average_grads()
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return norm
        if self.grad_clip > 0 and norm > self.grad_clip:
            scale = self.grad_clip / (norm + 1e-6)
            grads = [p.grad for p in self.dense_params + self.expert_params if p.grad is not None]
            torch._foreach_mul_(grads, scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return norm

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by this rank. torch's AdamW allocates its two moments (param dtype) at the first
        step, so the state is counted as what it will hold: 2 x the parameter bytes."""
        param_bytes = sum(p.numel() * p.element_size() for p in self.dense_params + self.expert_params)
        return {
            "param_bytes": param_bytes,
            "grad_bytes": param_bytes,
            "optim_state_bytes": 2 * param_bytes,
            "padding_bytes": 0,
        }

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
