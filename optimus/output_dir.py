"""A directory that a command writes as a whole: checked first, written beside its place, renamed into it.

`check_out_dir` refuses an --out that holds something not of the command's own kind (and an earlier output
unless --overwrite asks to replace it); `replacing_directory` yields a new sibling to write into, which takes
`out`'s place only when the block succeeds. Used by `optimus checkpoint import`, the HF export and
`optimus plan --dry-run --out`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from optimus.config import ConfigError
from optimus.data.cache import dead_staging, default_file_mode, remove_dead_staging, staging_path


def check_out_dir(out: Path, overwrite: bool, marker: str, what: str) -> None:
    """A directory that a command writes as a whole: new or empty, or, with `overwrite`, one that holds `marker`
    (an earlier output of the same kind; anything else is not ours to delete). What a writer of `out` killed
    on this host left beside it is cleared up first (_recover), so that the check sees what the user has."""
    try:
        _recover(out.resolve())
    except OSError as err:
        raise ConfigError(f"--out {out} cannot be written ({err.strerror}): choose another --out.") from None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: name a new directory to write {what} into.")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"--out {out} already exists: choose another --out, or pass --overwrite to replace it.")
    if not (out / marker).is_file():
        raise ConfigError(
            f"--out {out} holds no {marker}, so it is not {what} that --overwrite may replace: choose another --out."
        )


def _recover(target: Path) -> None:
    """Undo what writers of `target` killed on this host left beside it (replacing_directory's names). One killed
    between its two renames left no `target` and the earlier output as `.old`: that is put back (the newest, had
    several died so); every other leftover is deleted. Another host's are left: their writer may still run."""
    earlier = [path for path in dead_staging(target) if path.suffix == ".old"]
    if earlier and not os.path.lexists(target):
        os.rename(max(earlier, key=lambda path: path.stat().st_mtime), target)
    remove_dead_staging(target)


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
    except OSError as err:  # a full disk, a quota
        raise ConfigError(
            f"writing {out} failed ({err.strerror}); nothing was written: free space and rerun."
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
