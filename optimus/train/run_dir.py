"""Choosing and creating the run directory, the same one on every rank."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch.distributed as dist

from optimus.config import ConfigError, OptimusConfig
from optimus.parallel import ParallelState
from optimus.train.checkpoint import checkpoint_root, has_checkpoint


def default_run_dir(cfg: OptimusConfig) -> Path:
    return Path("runs") / f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def may_resume(cfg: OptimusConfig, run_dir: Path) -> bool:
    """A run directory may be reused by the same command when that run checkpoints (or left a checkpoint)."""
    return cfg.checkpoint.interval > 0 or has_checkpoint(checkpoint_root(cfg, run_dir))


def resume_hint(cfg: OptimusConfig, run_dir: Path) -> str:
    """How to resume this run: the same command, pinned to this run directory when it chose one itself."""
    if cfg.run.dir:
        return "run the same command again to resume"
    return f"run the same command with run.dir={run_dir} to resume"


def holds_run(run_dir: Path) -> bool:
    """True when run_dir has step records; an empty metrics.jsonl is a run that died before its first step."""
    path = Path(run_dir) / "metrics.jsonl"
    return path.exists() and path.stat().st_size > 0


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Keep the records of steps <= `step` (a resumed run re-does, and re-logs, the steps after its checkpoint)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True) if _record_step(line) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _record_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a line cut short by a kill


def resolve_run_dir(cfg: OptimusConfig, ps: ParallelState) -> Path:
    """Rank 0 decides (a timestamp could differ between ranks) and tells the others."""
    chosen = [None]
    if ps.is_main:
        run_dir = Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg)
        if holds_run(run_dir) and not may_resume(cfg, run_dir):
            chosen[0] = ConfigError(
                f"run.dir={run_dir} already holds a run (metrics.jsonl) without checkpoints to resume from: "
                "choose a new run.dir or move the old one away."
            )
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            chosen[0] = run_dir.resolve()
    if ps.is_distributed:
        dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], Exception):
        raise chosen[0]
    return chosen[0]
