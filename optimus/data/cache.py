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
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

from optimus.data.errors import DataError
from optimus.processes import process_exists


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


def staging_path(target: Path, kind: str = "tmp") -> Path:
    """A new name beside `target` for a folder that is written and then renamed to `target`:
    `.NAME.HOST.PID.RANDOM.KIND`, so that a later writer can tell whether the process that made it still runs."""
    return target.parent / f".{target.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.{kind}"


def dead_staging(target: Path) -> list[Path]:
    """The staging paths beside `target` (of any kind) whose writer ran on this host and runs no longer.
    Another host's are not listed: nothing here can tell whether its writer still runs."""
    if not target.parent.is_dir():
        return []
    name = re.compile(rf"\.{re.escape(target.name)}\.(?P<host>.+)\.(?P<pid>\d{{1,9}})\.[0-9a-f]{{8}}\.[a-z]+")
    host = socket.gethostname()
    found = [(path, name.fullmatch(path.name)) for path in target.parent.iterdir()]
    return sorted(path for path, m in found if m and m["host"] == host and not process_exists(int(m["pid"])))


def remove_dead_staging(target: Path) -> None:
    """Delete what writers of `target` killed on this host left beside it (a whole dataset, a whole model)."""
    for path in dead_staging(target):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


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
