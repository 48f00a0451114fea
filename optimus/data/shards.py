"""Token shards on disk: flat uint16/uint32 token arrays, document ends, and a metadata JSON.

Layout of a prepared directory:

    meta.json                 written last; a directory without it is not trusted
    .prepare-files.json       while moving new files in: their names (a rerun may remove those, nothing else)
    tokenizer.json            the tokenizer the shards were made with
    shard_00000.bin           raw tokens (each document followed by EOS), dtype from meta
    shard_00000.ends.npy      uint64 end offset (exclusive, after the EOS) of each document in the shard

A job writes its shards into a temporary sibling directory and moves them in
once all are complete (prepare.py). meta.json lists every file prepare created
("files"); only those are ever deleted or replaced, so a directory may hold the
user's own files too. The data's identity is `fingerprint(meta)`: its tokens'
checksums and counts, whatever path they are read from. On
load every shard's length is checked, and its checksum and largest token id are
verified once per file version: the result is remembered in the cache directory
under the file's identity (inode, size, mtime and ctime: a rewrite changes the
ctime even when it keeps the mtime), so later starts only stat the files.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimus.data.cache import atomic_path, cache_root, locked
from optimus.data.errors import DataError

FORMAT = "optimus-tokens-v1"
META = "meta.json"
JOURNAL = ".prepare-files.json"
TOKENIZER = "tokenizer.json"
_OUR_NAMES = ("shard_*.bin", "shard_*.ends.npy", TOKENIZER)  # names prepare writes (besides meta.json)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends documents (token ids + EOS) to shards of about `shard_tokens` tokens, each ending at a document end."""

    def __init__(
        self, out_dir: Path, vocab_size: int, eos_id: int, shard_tokens: int = 1 << 28, created: tuple[str, ...] = ()
    ):
        self.out_dir, self.eos_id, self.shard_tokens = out_dir, eos_id, shard_tokens
        self.dtype = token_dtype(vocab_size)
        self.shards: list[dict[str, Any]] = []
        self.n_docs = self.n_tokens = 0
        self._file = None
        self.created = list(created)  # files this writer's job made (meta.json's "files")

    def _open(self) -> None:
        name = f"shard_{len(self.shards):05d}"
        self.created += [f"{name}.bin", f"{name}.ends.npy"]
        self._name, self._tmp = name, self.out_dir / f".{name}.bin.tmp"
        self._file, self._hash, self._ends, self._count = open(self._tmp, "wb"), hashlib.sha256(), [], 0

    def add(self, docs: list[list[int]]) -> None:
        for ids in docs:
            if self._file is None:
                self._open()
            arr = np.asarray([*ids, self.eos_id], dtype=self.dtype)  # [len(ids) + 1]
            self._file.write(arr.tobytes())
            self._hash.update(arr.tobytes())
            self._count += len(arr)
            self._ends.append(self._count)
            if self._count >= self.shard_tokens:
                self._close()

    def _close(self) -> None:
        self._file.close()
        self._file = None
        ends = self.out_dir / f"{self._name}.ends.npy"
        with atomic_path(ends) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, np.asarray(self._ends, dtype=np.uint64))
        os.replace(self._tmp, self.out_dir / f"{self._name}.bin")
        self.shards.append(
            {
                "file": f"{self._name}.bin",
                "ends": ends.name,
                "n_tokens": self._count,
                "n_docs": len(self._ends),
                "sha256": self._hash.hexdigest(),
            }  # fmt: skip
        )
        self.n_docs += len(self._ends)
        self.n_tokens += self._count

    def finish(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Close the last shard and write meta.json (last, atomically); returns the metadata."""
        if self._file is not None:
            self._close()
        if not self.n_docs:
            raise DataError(f"no documents to write to {self.out_dir}: the input holds no non-empty text.")
        meta = {**meta, "format": FORMAT, "dtype": self.dtype.name, "n_docs": self.n_docs, "n_tokens": self.n_tokens,
                "shards": self.shards, "files": self.created}  # fmt: skip
        with atomic_path(self.out_dir / META) as tmp:
            tmp.write_text(json.dumps(meta, indent=2) + "\n")
        return meta


def write_journal(directory: Path, names: list[str]) -> None:
    """List `names` in `directory`'s journal before they appear there, so a killed job leaves them listed."""
    with atomic_path(directory / JOURNAL) as tmp:
        tmp.write_text(json.dumps(names) + "\n")


def owned_files(directory: Path, meta: dict[str, Any] | None = None) -> set[str]:
    """Names of the files an earlier prepare made in `directory`: those its meta.json (or, for an
    unfinished run, its journal) lists. Metadata older than the "files" list names its shards and tokenizer."""
    names: set[str] = set()
    if meta is not None:
        listed = meta.get("files")
        if listed is None:
            listed = [n for e in meta.get("shards", []) for n in (e["file"], e["ends"])] + [TOKENIZER]
        names.update(listed)
    try:
        names.update(json.loads((directory / JOURNAL).read_text()))
    except (OSError, ValueError, TypeError):
        pass
    return names


def foreign_files(directory: Path, owned: set[str]) -> list[Path]:
    """Entries of `directory` with a name prepare writes that no earlier prepare here made: never touched."""
    return sorted(p for pattern in _OUR_NAMES for p in directory.glob(pattern) if p.name not in owned)


def remove_token_files(directory: Path, owned: set[str]) -> None:
    """Delete the files prepare made (`owned`), its unfinished temporaries and journal; nothing else."""
    paths = [directory / name for name in owned]
    paths += [*directory.glob(".shard_*.bin.tmp"), *directory.glob(f".{META}.*.tmp"), directory / JOURNAL]
    for path in paths:
        if path.is_file() or path.is_symlink():  # a folder of the same name is not ours
            path.unlink()


def read_meta(directory: Path) -> dict[str, Any]:
    path = directory / META
    if not directory.is_dir():
        raise DataError(f"token directory {directory} does not exist: run `optimus data prepare --output {directory}`.")
    if not path.is_file():
        raise DataError(
            f"{directory} has no {META}, so it is not a finished token directory: run `optimus data prepare` into it."
        )
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e.msg}): re-run `optimus data prepare`.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(f"{path} has format {found!r}, not {FORMAT!r}: re-run `optimus data prepare`.")
    missing = _missing_meta_key(meta)
    if missing:
        raise DataError(
            f"{path} has no valid {missing} (the file is incomplete or was edited): re-run `optimus data prepare` "
            f"into {directory}."
        )
    return meta


def _missing_meta_key(meta: dict[str, Any]) -> str | None:
    """The first key that open_tokens and fingerprint read and `meta` lacks or holds in another form, or None."""
    if meta.get("dtype") not in ("uint16", "uint32"):
        return "'dtype' (uint16 or uint32)"
    tokenizer = meta.get("tokenizer")
    for key in ("id", "vocab_size", "eos_id"):
        if not isinstance(tokenizer, dict) or key not in tokenizer:
            return f"'tokenizer.{key}'"
    shards = meta.get("shards")
    if not isinstance(shards, list):
        return "'shards' list"
    for i, entry in enumerate(shards):
        for key in ("file", "ends", "n_tokens", "n_docs", "sha256"):
            if not isinstance(entry, dict) or key not in entry:
                return f"'shards[{i}].{key}'"
    return None


def fingerprint(meta: dict[str, Any]) -> str:
    """The identity of a token directory's contents, not of its path: a hash of its tokenizer, token dtype and
    each shard's checksum and counts (what open_tokens verifies the files against). Re-made from other text, it
    changes; copied or moved elsewhere, or named by another path, it does not."""
    shards = [(s["sha256"], s["n_tokens"], s["n_docs"]) for s in meta["shards"]]
    content = json.dumps([FORMAT, meta["dtype"], meta["tokenizer"]["id"], shards])
    return "sha256:" + hashlib.sha256(content.encode()).hexdigest()[:16]


def _verify_contents(path: Path, entry: dict[str, Any], dtype: np.dtype, vocab_size: int) -> None:
    """Checksum and token range of one shard; a success is remembered per file version and expected checksum."""
    st = path.stat()
    version = f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    key = hashlib.sha256(f"{version}|{entry['sha256']}|{vocab_size}".encode())
    marker = cache_root() / "verified" / key.hexdigest()
    if marker.exists():
        return
    h, top = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
            if len(block) >= dtype.itemsize:
                top = max(top, int(np.frombuffer(block, dtype=dtype).max()))
    if h.hexdigest() != entry["sha256"]:
        raise DataError(f"{path} does not match the checksum in its {META}: the shard is corrupt; re-run prepare.")
    if top >= vocab_size:
        raise DataError(
            f"{path} holds token id {top} >= the vocabulary size {vocab_size} in its {META}: "
            "the shard was made with another tokenizer; re-run prepare."
        )
    try:
        with locked(marker):
            marker.write_text("ok\n")
    except (DataError, OSError):
        pass  # a read-only cache only costs the check again next time


def _load_ends(path: Path, entry: dict[str, Any]) -> np.ndarray:
    try:
        ends = np.load(path)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} cannot be read ({e}): the directory is incomplete; re-run prepare.") from None
    if len(ends) != entry["n_docs"] or (len(ends) and int(ends[-1]) != entry["n_tokens"]):
        raise DataError(f"{path} does not match the document count in its {META}: re-run prepare.")
    return ends


class TokenStream:
    """Several 1-D token arrays (memory-mapped shards or in-memory) read as one concatenated array."""

    def __init__(self, pieces: list[np.ndarray]):
        self.pieces = [p for p in pieces if len(p)]
        self.starts = np.cumsum([0] + [len(p) for p in self.pieces])  # [n_pieces + 1]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        if start >= stop:
            return np.zeros(0, dtype=self.pieces[0].dtype if self.pieces else np.int64)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < stop:
            piece, off = self.pieces[first], start - int(self.starts[first])
            take = min(stop - start, len(piece) - off)
            parts.append(piece[off : off + take])
            start, first = start + take, first + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def slice(self, start: int, stop: int) -> TokenStream:
        """Tokens [start, stop) as a stream of views (no copy of memory-mapped data)."""
        pieces = []
        for piece, lo in zip(self.pieces, self.starts[:-1], strict=True):
            a, b = max(start - int(lo), 0), min(stop - int(lo), len(piece))
            if a < b:
                pieces.append(piece[a:b])
        return TokenStream(pieces)

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows tokens[s : s + length] for each s in `starts`, as int64 [len(starts), length]."""
        if len(self.pieces) == 1:
            return self.pieces[0][starts[:, None] + np.arange(length)].astype(np.int64)
        return np.stack([self.read(int(s), int(s) + length) for s in starts]).astype(np.int64)


@dataclass
class TokenSource:
    """A prepared token directory opened for reading."""

    directory: Path
    meta: dict[str, Any]
    stream: TokenStream
    doc_ends: np.ndarray  # [n_docs] global exclusive end of each document (after its EOS)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["tokenizer"]["eos_id"])

    @property
    def tokenizer_id(self) -> str:
        return str(self.meta["tokenizer"]["id"])


def open_tokens(directory: Path | str) -> TokenSource:
    """Open a prepared directory memory-mapped, after checking every shard against its metadata."""
    directory = Path(directory).expanduser()
    meta = read_meta(directory)
    dtype, vocab = np.dtype(meta["dtype"]), int(meta["tokenizer"]["vocab_size"])
    pieces, ends, offset = [], [], 0
    for entry in meta["shards"]:
        path = directory / entry["file"]
        if not path.is_file():
            raise DataError(f"shard {path} listed in {directory / META} is missing: re-run prepare into {directory}.")
        if path.stat().st_size != entry["n_tokens"] * dtype.itemsize:
            raise DataError(
                f"shard {path} has {path.stat().st_size} bytes but its {META} says {entry['n_tokens']} tokens of "
                f"{dtype.name}: the shard is truncated or corrupt; re-run prepare."
            )
        _verify_contents(path, entry, dtype, vocab)
        ends.append(_load_ends(directory / entry["ends"], entry).astype(np.int64) + offset)
        pieces.append(np.memmap(path, dtype=dtype, mode="r"))
        offset += entry["n_tokens"]
    return TokenSource(directory, meta, TokenStream(pieces), np.concatenate(ends) if ends else np.zeros(0, np.int64))
