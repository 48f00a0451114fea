"""A command that must not change these files: snapshot a tree before, run, compare.

    from tests.unchanged import unchanged

    with unchanged(tmp_path / "model", tmp_path / "corpus.jsonl"):
        with pytest.raises(SystemExit):
            main(["checkpoint", "export", ...])

Every writing command's refusal test wraps the refused call in `unchanged(...)` over what the command could
have touched (its output, its inputs, their parent directory): a refusal that writes first and fails later
(a half-written directory, an overwritten input, a left-over temporary) fails the test with the difference
named file by file. The snapshot is each file's bytes (as a SHA-256) and mode, and the set of paths, so an
added, removed, rewritten or re-permissioned file is all caught; directories are walked recursively.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path


def snapshot(*roots: str | os.PathLike) -> dict[str, tuple[str, int] | None]:
    """{path: (sha256 of its bytes, mode), or None for a directory} of every path under the roots (and the
    roots themselves); a root that does not exist is recorded as absent by having no entry."""
    files: dict[str, tuple[str, int] | None] = {}
    for root in map(Path, roots):
        if not root.exists():
            continue
        paths = [root] + sorted(root.rglob("*")) if root.is_dir() else [root]
        for path in paths:
            if path.is_dir():
                files[str(path)] = None
            else:
                files[str(path)] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mode & 0o777)
    return files


def differences(before: dict, after: dict) -> list[str]:
    """One line per path that was added, removed or changed between two snapshots."""
    lines = [f"added: {p}" for p in sorted(after.keys() - before.keys())]
    lines += [f"removed: {p}" for p in sorted(before.keys() - after.keys())]
    for path in sorted(before.keys() & after.keys()):
        if before[path] != after[path]:
            old, new = before[path], after[path]
            what = "mode" if old and new and old[0] == new[0] else "contents"
            lines.append(f"changed ({what}): {path}")
    return lines


@contextlib.contextmanager
def unchanged(*roots: str | os.PathLike) -> Iterator[None]:
    """Assert that the body (which may raise: the exception propagates after the check) leaves every file and
    directory under `roots` exactly as it found it."""
    before = snapshot(*roots)
    try:
        yield
    finally:
        changes = differences(before, snapshot(*roots))
        assert not changes, "the command changed files it must leave alone:\n" + "\n".join(changes)
