"""Cache directory, cross-process locks and atomic file writes.

Several ranks may start at once and all want the same tokenizer or token
cache. A file lock makes one of them do the work while the others wait, and
every file is written under a temporary name and renamed into place, so a
reader never sees half a file and a killed writer leaves nothing trusted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

from optimus.data.errors import DataError


def cache_root() -> Path:
    """`$OPTIMUS_CACHE`, else the platform's user cache directory, else ~/.cache/optimus."""
    env = os.environ.get("OPTIMUS_CACHE")
    if env:
        return Path(env).expanduser()
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("optimus"))
    except ImportError:
        return Path.home() / ".cache" / "optimus"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path`.lock for the duration of the block (works across processes)."""
    lock = FileLock(str(path) + ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as err:
        raise DataError(
            f"cannot write to the cache directory {path.parent} ({err.strerror or err}): set OPTIMUS_CACHE to a "
            "directory you may write to."
        ) from None
    try:
        yield
    finally:
        lock.release()


def default_file_mode() -> int:
    """The mode `open()` gives a new file under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path in the same directory; it replaces `path` only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, default_file_mode())  # mkstemp makes 0600; shared data must be readable like any other file
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_error(what: str, err: OSError, elsewhere: str) -> DataError:
    """The one sentence for a write that failed (a full disk, a read-only file system): what, why, what to do."""
    fix = "free space on its file system" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
    return DataError(f"writing {what} failed ({err.strerror or err}): {fix} or {elsewhere}, then run again.")


def write_json(path: Path, obj: object) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
