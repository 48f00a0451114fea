"""A directory that a command writes as a whole: checked first, written beside its place, renamed into it.

`check_out_dir` refuses an --out that cannot be written (a file on the way to it, a directory this process may
not write in, a read-only file system, a mount point, which cannot be renamed) or that holds something not of
the command's own kind (an earlier output only with --overwrite, and only when it holds nothing but the files
such an output is made of: a file the user put there is not the command's to delete); `replacing_directory`
yields a new sibling to write into, which takes `out`'s place only when the block succeeds. Used by `optimus
checkpoint import`, the HF export, `optimus plan --dry-run --out`, `optimus selftest --out` and `optimus plan
--calibrate --out` (optimus.commands.selftest names their files).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from optimus.config import ConfigError
from optimus.data.cache import dead_staging, default_file_mode, remove_dead_staging, staging_path

NAMED = 5  # the files a refusal names, at most


def check_out_dir(out: Path, overwrite: bool, marker: str, what: str, written: tuple[str, ...]) -> None:
    """A directory that a command writes as a whole: new or empty, or, with `overwrite`, one that holds `marker`
    (an earlier output of the same kind) and nothing but what such an output is made of: paths relative to it
    that match one of the patterns `written` (fnmatch, e.g. "rank*.json", "model/*.yaml"). Anything else is not
    ours to delete. What a writer of `out` killed on this host left beside it is cleared up first (_recover), so
    that the check sees what the user has."""
    target = out.resolve()
    _check_writable(out, target.parent)
    try:
        _recover(target)
    except OSError as err:
        raise ConfigError(f"--out {out} cannot be written ({err.strerror}): choose another --out.") from None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: name a new directory to write {what} into.")
    if target.is_dir() and os.path.ismount(target):
        raise ConfigError(
            f"--out {out} is a mount point, which cannot be replaced (the output is written beside it and renamed "
            "into its place): name a directory inside it."
        )
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"--out {out} already exists: choose another --out, or pass --overwrite to replace it.")
    if not (out / marker).is_file():
        raise ConfigError(
            f"--out {out} holds no {marker}, so it is not {what} that --overwrite may replace: choose another --out."
        )
    others = not_written(target, written)
    if others:
        names = ", ".join(others[:NAMED]) + (f" and {len(others) - NAMED} more" if len(others) > NAMED else "")
        raise ConfigError(
            f"--out {out} holds files that {what} is not made of ({names}), which --overwrite would delete: move "
            "them out of it, or choose another --out."
        )


def not_written(directory: Path, written: tuple[str, ...]) -> list[str]:
    """Paths under `directory` (relative, sorted) that match none of the patterns `written`: files, links and
    directories that hold none of the matching files (a link is not followed)."""
    parents = {pattern.rsplit("/", 1)[0] for pattern in written if "/" in pattern}
    others = []
    for root, dirs, files in os.walk(directory):
        base = Path(root).relative_to(directory)
        for name in dirs + files:
            relative = (base / name).as_posix()
            if Path(root, name).is_dir() and not Path(root, name).is_symlink():
                if not any(fnmatch.fnmatchcase(relative, parent) for parent in parents):
                    others.append(relative + "/")
                    dirs.remove(name)  # named once, as a whole
            elif not any(fnmatch.fnmatchcase(relative, pattern) for pattern in written):
                others.append(relative)
    return sorted(others)


def _check_writable(out: Path, parent: Path) -> None:
    """The output is written beside `out`, in `parent` (made first when it does not exist): the nearest
    directory on the way there that exists must be one this process may create entries in. Checked before the
    work, which would otherwise run to its end for nothing. os.access answers for root too where a file system
    is read-only."""
    existing = parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {out} cannot be written ({existing} is a file): choose another --out.")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "a read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "no permission to write"
        raise ConfigError(f"--out {out} cannot be written ({why} at {existing}): choose another --out.")


def _recover(target: Path) -> None:
    """Undo what writers of `target` killed on this host left beside it (replacing_directory's names). One killed
    between its two renames left no `target` and the earlier output as `.old`: that is put back (the newest, had
    several died so); every other leftover is deleted. Another host's are left: their writer may still run."""
    earlier = [path for path in dead_staging(target) if path.suffix == ".old"]
    if earlier and not os.path.lexists(target):
        os.rename(max(earlier, key=lambda path: path.stat().st_mtime), target)
    remove_dead_staging(target)


def _failed(out: Path, err: OSError) -> ConfigError:
    """What to do when writing `out` failed: free space when the disk or a quota is full, else another --out."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return ConfigError(f"writing {out} failed ({err.strerror}); nothing was written: free space and rerun.")
    return ConfigError(f"writing {out} failed ({err.strerror}); nothing was written: choose another --out.")


@contextlib.contextmanager
def replacing_directory(out: Path) -> Iterator[Path]:
    """Yield a new empty directory beside `out` to write into; when the block succeeds it takes `out`'s place
    (an existing `out` is removed only after), when it fails it is removed and `out` is left as it was.
    A symlink `out` stays: the directory it points to is the one replaced, and the new one is written beside it."""
    target = out.resolve()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = staging_path(target)
        tmp.mkdir()  # mode from the umask, unlike tempfile.mkdtemp's 0700
    except OSError as err:
        raise ConfigError(f"--out {out} cannot be written ({err.strerror}): choose another --out.") from None
    try:
        yield tmp
        for file in tmp.rglob("*"):  # safetensors creates its files 0600; the umask decides, as for any file
            if file.is_file():
                os.chmod(file, default_file_mode())
        old = tmp.with_suffix(".old")
        if target.exists():
            os.rename(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            if old.exists():  # put the earlier output back
                os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    except OSError as err:  # a full disk, a quota; a mount point that appeared since the check
        raise _failed(out, err) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
