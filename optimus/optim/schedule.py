"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

import math

from optimus.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Warmup steps 0..W-1 rise linearly to the peak `lr` (reached at step W-1); the decay steps
    W..T-1 follow a cosine from the peak to `lr * min_lr_ratio`, which the last step uses.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps + 1) / decay_steps)
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))
