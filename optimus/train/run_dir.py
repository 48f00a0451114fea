"""Choosing and creating the run directory, the same one on every rank."""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from optimus.config import ConfigError, OptimusConfig
from optimus.parallel import ParallelState


def default_run_dir(cfg: OptimusConfig) -> Path:
    return Path("runs") / f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_run_dir(cfg: OptimusConfig, ps: ParallelState) -> Path:
    """Rank 0 decides (a timestamp could differ between ranks) and tells the others."""
    chosen = [None]
    if ps.is_main:
        run_dir = Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg)
        if (run_dir / "metrics.jsonl").exists():
            chosen[0] = ConfigError(
                f"run.dir={run_dir} already holds a run (metrics.jsonl): choose a new run.dir or move the old one away."
            )
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            chosen[0] = run_dir.resolve()
    if ps.is_distributed:
        dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], Exception):
        raise chosen[0]
    return chosen[0]
