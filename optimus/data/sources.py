"""Document readers: the built-in stdlib corpus, text/JSONL/Parquet files, and `datasets` datasets.

Every reader yields documents (strings) in a deterministic order and names the
file (and line) of any input it cannot read. Empty documents are skipped.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from optimus.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
TXT_DOC_CHARS = 1 << 24  # a .txt file longer than this is cut at line ends into documents of about this size
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_docs(max_chars: int) -> list[str]:
    """The .py files of this interpreter's standard library, in sorted path order, capped at `max_chars` in total."""
    root = sysconfig.get_paths()["stdlib"]
    docs, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(f for f in filenames if f.endswith(".py")):
            try:
                text = Path(dirpath, name).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # a few test files are deliberately not UTF-8
            if not text:
                continue
            text = text[: max_chars - total]  # the last document is cut to fit the cap exactly
            docs.append(text)
            total += len(text)
            if total >= max_chars:
                return docs
    return docs


# Suffixes of local files, never of a Hugging Face Hub name (those may hold dots: "gpt-neo-1.3B").
_FILE_SUFFIXES = (*TEXT_SUFFIXES, ".json", ".gz", ".zst", ".arrow", ".csv", ".model", ".bin", ".safetensors")


def looks_like_path(spec: str) -> bool:
    """True when `spec` can only be meant as a local path, not a Hub name ("name" or "org/name"): it starts
    with . ~ or /, ends in a file suffix, has more than one /, or its first folder exists here."""
    if spec.startswith((".", "~", "/")) or spec.lower().endswith(_FILE_SUFFIXES) or spec.count("/") > 1:
        return True
    return "/" in spec and Path(spec.split("/", 1)[0]).is_dir()


def require_path_or_name(spec: str, key: str) -> bool:
    """True when `spec` exists locally; False for a Hub name; a path-looking spec that is missing is an error
    now (a Hub lookup of it would retry for half a minute before failing)."""
    if Path(spec).expanduser().exists():
        return True
    if looks_like_path(spec):
        raise DataError(f"{key}: {spec} does not exist: check the path.")
    return False


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return next((s for s in TEXT_SUFFIXES if name.endswith(s)), "")


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def expand_paths(spec: Any, key: str = "data.path") -> list[Path]:
    """A file, a directory (searched recursively, sorted) or a list of them -> data files and saved datasets."""
    if spec is None or spec == "" or (isinstance(spec, (list, tuple)) and not spec):
        raise DataError(f"{key} is empty: set it to a file, a directory or a list of them.")
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    out: list[Path] = []
    for item in items:
        path = Path(str(item)).expanduser()
        if not path.exists():
            raise DataError(f"{key}: {path} does not exist: check the path.")
        if path.is_file() or _is_saved_dataset(path):
            out.append(path)
            continue
        found = sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p))
        if not found:
            raise DataError(f"{key}: directory {path} has no {', '.join(TEXT_SUFFIXES)} files: point it at your data.")
        out.extend(found)
    return out


def _decode(raw: bytes, path: Path, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"{path} line {line}" if line else str(path)
        raise DataError(
            f"{where} is not valid UTF-8 (byte {e.start}): convert the file to UTF-8, e.g. with iconv."
        ) from None


def _txt_docs(path: Path) -> Iterator[str]:
    text = _decode(path.read_bytes(), path)
    while len(text) > TXT_DOC_CHARS:  # huge files: cut after a newline so no document is too large to encode
        cut = text.rfind("\n", 0, TXT_DOC_CHARS) + 1 or TXT_DOC_CHARS
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


def _open_lines(path: Path) -> io.BufferedIOBase:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path} is zstd-compressed but `zstandard` is missing: pip install zstandard.") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _jsonl_docs(path: Path, text_field: str) -> Iterator[str]:
    with _open_lines(path) as f:
        for n, raw in enumerate(f, start=1):
            line = _decode(raw, path, n).strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {n} is not valid JSON ({e.msg}): fix or remove that line.") from None
            if not isinstance(obj, dict) or text_field not in obj:
                raise DataError(
                    f"{path} line {n} has no field {text_field!r}: set data.text_field (--text-field) to the field "
                    "that holds the text."
                )
            text = obj[text_field]
            if not isinstance(text, str):
                raise DataError(f"{path} line {n}: field {text_field!r} is not a string: store the text as a string.")
            if text:
                yield text


def _parquet_docs(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path} is not a readable Parquet file ({e}): check the file.") from None
    if text_field not in pf.schema_arrow.names:
        raise DataError(f"{path} has no column {text_field!r}: set data.text_field (--text-field) to the text column.")
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        yield from (t for t in batch.column(0).to_pylist() if t)


def dataset_docs(ds: Any, name: str, text_field: str) -> Iterator[str]:
    if text_field not in ds.column_names:
        raise DataError(
            f"dataset {name} has no column {text_field!r} (it has {', '.join(ds.column_names)}): set data.text_field."
        )
    for batch in ds.select_columns([text_field]).iter(batch_size=1024):
        yield from (t for t in batch[text_field] if t)


def load_hf(spec: str, split: str, config: str | None) -> Any:
    """A `datasets.Dataset` from a saved dataset directory, a local data directory or a hub name (cached)."""
    import datasets

    path = Path(spec).expanduser()
    require_path_or_name(spec, "data.path")
    try:
        if _is_saved_dataset(path):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"dataset {path} has no split {split!r} (only {', '.join(ds)}): set data.hf_split.")
                ds = ds[split]
            return ds
        return datasets.load_dataset(str(path) if path.exists() else spec, config, split=split)
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"could not load dataset {spec!r} (split {split!r}, config {config!r}): {type(e).__name__}: {e}; "
            "check data.path, data.hf_split and data.hf_config."
        ) from e


def file_docs(path: Path, text_field: str, hf_split: str = "train") -> Iterator[str]:
    """Documents of one input: a .txt file is one document, a JSONL line or Parquet row one each."""
    try:
        yield from _file_docs(path, text_field, hf_split)
    except (OSError, EOFError, zlib.error) as err:  # raised while reading only: the consumer's errors stay its own
        raise DataError(
            f"{path} cannot be read ({err}): if it is truncated or not compressed as its name says, re-create it "
            "or rename it to match its contents."
        ) from None


def _file_docs(path: Path, text_field: str, hf_split: str) -> Iterator[str]:
    if _is_saved_dataset(path):
        yield from dataset_docs(load_hf(str(path), hf_split, None), str(path), text_field)
        return
    suffix = _suffix(path)
    if suffix == ".txt":
        yield from _txt_docs(path)
    elif suffix.startswith(".jsonl"):
        yield from _jsonl_docs(path, text_field)
    elif suffix == ".parquet":
        yield from _parquet_docs(path, text_field)
    else:
        raise DataError(f"{path} has an unsupported type: use {', '.join(TEXT_SUFFIXES)} files.")


def iter_docs(paths: Iterable[Path], text_field: str, hf_split: str = "train") -> Iterator[str]:
    for path in paths:
        yield from file_docs(path, text_field, hf_split)
