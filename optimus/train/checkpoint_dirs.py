"""A checkpoint directory on disk: which checkpoints it holds, which to try first, whether one is complete, and
why writing one failed.

On disk (`checkpoint.dir`, default <run.dir>/checkpoints):

    step_000100.tmp/   being written by every rank; never read
    step_000100/       published: DCP files (.metadata + one file per rank), meta.json, config.yaml
    latest             the name of the newest published checkpoint, replaced atomically

Apart from the Checkpointer (optimus.train.checkpoint), which saves and loads on every rank together: nothing
here needs a process group, so the run directory's checks, `optimus checkpoint` and the Hugging Face export use it
without the saving and loading machinery.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from optimus.config import ConfigError, OptimusConfig
from optimus.train.checkpoint_checks import untrusted_record
from optimus.train.metrics import write_problem

LATEST = "latest"
META = "meta.json"
TMP_SUFFIX = ".tmp"
STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_root(cfg: OptimusConfig, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def published(root: Path) -> list[Path]:
    """Published checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def candidates(root: Path) -> list[Path]:
    """Checkpoints to try, in order: the one `latest` names, then older published ones, newest first."""
    all_ = published(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if STEP_DIR.match(name) and (root / name) in all_:
            older = [p for p in all_ if step_of(p) < step_of(root / name)]
            return [root / name, *reversed(older)]
    return list(reversed(all_))


def has_checkpoint(root: Path) -> bool:
    return bool(candidates(root))


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def resolve_checkpoint(path: str | Path, key: str = "checkpoint.load") -> Path:
    """A step directory, or a checkpoint root whose `latest` (or newest) checkpoint is taken."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    found = candidates(p) if p.is_dir() else []
    if not found:
        raise ConfigError(
            f"{key}={path} is not a checkpoint: give a step directory (holding .metadata) or a checkpoint "
            "directory that holds step_* directories."
        )
    return found[0]


def inspect(path: Path, resume: bool = False) -> tuple[str | None, Any]:
    """(why `path` cannot be loaded, or None; its DCP metadata): checks .metadata, file sizes, and that
    meta.json vouches for every file (with `resume`, also for the run's settings)."""
    if not (path / META).is_file():
        return f"{path / META} is missing", None
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # unpickling garbage raises anything
        return f"its .metadata is unreadable ({type(err).__name__}: {err})", None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        f = path / rel
        if not f.is_file():
            return f"{f} is missing", None
        if f.stat().st_size < size:
            return f"{f} is truncated ({f.stat().st_size} of {size} bytes)", None
    problem = untrusted_record(path, {".metadata", *needed}, resume)
    return (problem, None) if problem else (None, metadata)


def holds_weights_only(path: Path) -> bool:
    """Whether checkpoint `path` has model entries and no optimizer state (`optimus checkpoint import`'s)."""
    try:
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # unreadable: loading it reports why
        return False
    return any(k.startswith("model/") for k in keys) and not any(k.startswith("optim/") for k in keys)


class CheckpointWriteError(ConfigError):
    """A checkpoint could not be written (disk full, quota, permissions). Said in one sentence like a user
    error: what to fix is the file system, after which the same command resumes from the last good one."""


def write_failure(err: BaseException, root: Path) -> tuple[str, str]:
    """(the cause of a failed save in words, what to do), from the errors that DCP collected from the ranks and
    what each was raised from (see write_problem)."""
    found = [e for e, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
    for e in list(found):  # and what each was raised from (the error itself comes first)
        found += [c for c in (e.__cause__, e.__context__) if c is not None and c not in found]
    return write_problem(found, root)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
