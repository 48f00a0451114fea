"""Choosing and creating the run directory, the same one on every rank."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from optimus.config import ConfigError, OptimusConfig
from optimus.parallel import ParallelState
from optimus.train.checkpoint import LATEST, TMP_SUFFIX, checkpoint_root, has_checkpoint, published


def default_run_dir(cfg: OptimusConfig) -> Path:
    return Path("runs") / f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"


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


RUN_FILES = ("metrics.jsonl", "run_info.json", "config.yaml")  # what a run writes at the top of its directory
_created: list[Path] = []  # run directories this process made (removed again if a failed start left them empty)


def _refuse_reuse(cfg: OptimusConfig, run_dir: Path) -> str | None:
    """Why `run_dir` cannot take this run: it holds another run's records but no checkpoint to resume."""
    if cfg.run.overwrite or has_checkpoint(checkpoint_root(cfg, run_dir)):
        return None  # resumed (the checkpoint's settings are compared on load), or started afresh on request
    if holds_run(run_dir):
        return (
            f"run.dir={run_dir} already holds a run (metrics.jsonl) without a checkpoint to resume from: "
            "choose another run.dir, or pass run.overwrite=true to replace that run."
        )
    return None


def clear_run(cfg: OptimusConfig, run_dir: Path) -> None:
    """run.overwrite=true: remove the old run's records and checkpoints (nothing else in the directory)."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    root = checkpoint_root(cfg, run_dir)
    if root.is_dir():
        for path in [*published(root), *root.glob(f"step_*{TMP_SUFFIX}")]:
            shutil.rmtree(path, ignore_errors=True)
        (root / LATEST).unlink(missing_ok=True)


def _make_run_dir(cfg: OptimusConfig, run_dir: Path) -> Path | ConfigError:
    if run_dir.exists() and not run_dir.is_dir():
        return ConfigError(f"run.dir={run_dir} is a file, not a directory: choose another run.dir.")
    problem = _refuse_reuse(cfg, run_dir)
    if problem:
        return ConfigError(problem)
    try:
        if not run_dir.exists():
            run_dir.mkdir(parents=True)
            _created.append(run_dir.resolve())
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        return ConfigError(
            f"run.dir={run_dir} cannot be written ({err.strerror}): choose a run.dir where you may write files."
        )
    if cfg.run.overwrite and (holds_run(run_dir) or has_checkpoint(checkpoint_root(cfg, run_dir))):
        clear_run(cfg, run_dir)
    return run_dir.resolve()


def remove_if_empty() -> None:
    """After a failed start: drop the run directories this process created and left empty."""
    while _created:
        path = _created.pop()
        try:
            path.rmdir()  # only succeeds on an empty directory
        except OSError:
            pass


def resolve_run_dir(cfg: OptimusConfig, ps: ParallelState) -> Path:
    """Rank 0 decides (a timestamp could differ between ranks) and tells the others."""
    chosen: list[Path | ConfigError | None] = [None]
    if ps.is_main:
        chosen[0] = _make_run_dir(cfg, Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg))
    if ps.is_distributed:
        dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], Exception):
        raise chosen[0]
    return chosen[0]
