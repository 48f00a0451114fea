"""Tokenise documents into a token directory (see `shards.py`), optionally with several processes.

`write_tokens` is shared by `optimus data prepare` and the on-the-fly caches of
data=builtin/text/hf. Documents keep their input order whatever the number of
processes, so the shards are identical for any --num-proc.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from optimus.data.cache import remove_dead_staging, staging_path, write_error
from optimus.data.errors import DataError
from optimus.data.shards import (
    JOURNAL,
    META,
    TOKENIZER,
    ShardWriter,
    foreign_files,
    owned_files,
    remove_token_files,
    write_journal,
)
from optimus.data.sources import dataset_docs, expand_paths, iter_docs, load_hf, require_path_or_name
from optimus.data.tokenizer import TokenizerInfo, encode_docs, load_tokenizer

log = logging.getLogger(__name__)
_CHUNK_CHARS = 1 << 20  # text per unit of work handed to a process
ELSEWHERE = "write them elsewhere (another --output, or OPTIMUS_CACHE for data=builtin/text/hf)"
_worker_tok: Tokenizer | None = None


def _chunks(docs: Iterable[str]) -> Iterator[list[str]]:
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= _CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _init_worker(tok_json: str) -> None:
    global _worker_tok
    _worker_tok = Tokenizer.from_str(tok_json)


def _encode_chunk(chunk: list[str]) -> tuple[list[list[int]], int]:
    return encode_docs(_worker_tok, chunk), sum(len(d.encode()) for d in chunk)


def write_tokens(
    out_dir: Path,
    docs: Iterable[str],
    info: TokenizerInfo,
    extra_meta: dict[str, Any],
    num_proc: int = 1,
    progress: bool = False,
    shard_tokens: int = 1 << 28,
    describe_inputs: str = "the input",
    total_bytes: int | None = None,
    replaces: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Encode `docs` (each followed by EOS) into shards in `out_dir`; meta.json is written last.
    `replaces`: the metadata of the output being overwritten. Only files an earlier prepare made are
    removed or replaced; any other file where a shard or the tokenizer would go stops the job first.
    The shards are written into a temporary sibling of `out_dir` and moved in only once all are complete,
    so a job that fails (an unreadable input, a full disk) leaves `out_dir` as it found it; the staging
    directories of jobs killed on this host are removed when the next job for `out_dir` starts."""
    owned, keep_tokenizer = _check_output(out_dir, info, replaces)
    target = out_dir.resolve()  # a symlinked output: its staging directory goes beside the real one
    staging = staging_path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_staging(target)
        staging.mkdir()  # not mkdtemp: its mode 0700 would become the output's
        created = () if keep_tokenizer else (TOKENIZER,)  # the user's identical tokenizer.json stays theirs
        if created:  # written from Python, so a full disk is an OSError like every other write here
            (staging / TOKENIZER).write_text(info.tokenizer.to_str(pretty=True), encoding="utf-8")
        writer = ShardWriter(staging, info.vocab_size, info.eos_id, shard_tokens, created)
        if not _encode(writer, docs, info, num_proc, progress, total_bytes):
            raise DataError(f"{describe_inputs} has no non-empty documents: point the input at files with text.")
        tok_meta = {"id": info.id, "name": info.name, "vocab_size": info.vocab_size, "eos_id": info.eos_id}
        meta = writer.finish({**extra_meta, "tokenizer": tok_meta})
        _move_in(staging, target, owned)
    except OSError as err:
        raise write_error(f"the token shards for {out_dir}", err, ELSEWHERE) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return meta


def _check_output(out_dir: Path, info: TokenizerInfo, replaces: dict[str, Any] | None) -> tuple[set[str], bool]:
    """(the files an earlier prepare made in `out_dir`, whether its tokenizer.json is this one and stays);
    refuses an output that is a file or holds files of prepare's names that prepare did not make."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--output {out_dir} is a file: choose a directory for the shards.")
    if not out_dir.exists():
        return set(), False
    owned = owned_files(out_dir, replaces)
    tok_path = out_dir / TOKENIZER
    keep_tokenizer = tok_path.name not in owned and _same_tokenizer(tok_path, info)
    foreign = [p for p in foreign_files(out_dir, owned) if not (p == tok_path and keep_tokenizer)]
    if foreign:
        raise DataError(
            f"{out_dir} already holds {foreign[0].name}, which no earlier `optimus data prepare` there made: "
            "move it away or choose another --output (prepare never replaces files it did not write)."
        )
    return owned, keep_tokenizer


def _encode(writer: ShardWriter, docs: Iterable[str], info: TokenizerInfo, num_proc: int, progress: bool,
            total_bytes: int | None) -> int:  # fmt: skip
    """Tokenise `docs` into `writer`; returns the number of documents written."""
    bar, n_docs = _progress_bar(progress, total_bytes), 0
    chunks = _chunks(docs)
    if num_proc > 1:
        # Fresh worker processes: a fork of a process whose tokenizer or torch thread pools already ran can
        # deadlock in the child (a pool lock held by a thread that the fork did not copy).
        ctx = mp.get_context("spawn")
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, and no warning after fork
        try:
            with ctx.Pool(num_proc, initializer=_init_worker, initargs=(info.tokenizer.to_str(),)) as pool:
                for ids, nbytes in pool.imap(_encode_chunk, chunks):
                    writer.add(ids)
                    n_docs += len(ids)
                    if bar is not None:
                        bar.update(nbytes)
        finally:
            if saved is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
    else:
        for chunk in chunks:
            writer.add(encode_docs(info.tokenizer, chunk))
            n_docs += len(chunk)
            if bar is not None:
                bar.update(sum(len(d.encode()) for d in chunk))
    if bar is not None:
        bar.close()
    return n_docs


def _move_in(staging: Path, out_dir: Path, owned: set[str]) -> None:
    """Put the finished job in `staging` in place of `out_dir`'s earlier shards (`owned`), meta.json last."""
    if not out_dir.exists():
        os.replace(staging, out_dir)  # one rename: there is nothing of the user's to keep beside it
        return
    (out_dir / META).unlink(missing_ok=True)  # untrusted from here on, until the new metadata is in place
    remove_token_files(out_dir, owned)
    names = sorted(p.name for p in staging.iterdir() if p.name != META)
    write_journal(out_dir, names)
    for name in names:
        os.replace(staging / name, out_dir / name)
    os.replace(staging / META, out_dir / META)
    (out_dir / JOURNAL).unlink()


def _same_tokenizer(path: Path, info: TokenizerInfo) -> bool:
    try:
        return Tokenizer.from_file(str(path)).to_str() == info.tokenizer.to_str()
    except Exception:  # not a tokenizer file at all
        return False


def _progress_bar(enabled: bool, total: int | None) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", dynamic_ncols=True)


def _plain_size(inputs: list[str]) -> int | None:
    """Bytes of text in `inputs` when they are all uncompressed .txt/.jsonl files (the progress bar's total)."""
    try:
        paths = [p for spec in inputs for p in expand_paths(spec, "--input")]
    except DataError:
        return None
    if not all(p.is_file() and p.name.endswith((".txt", ".jsonl")) for p in paths):
        return None
    return sum(p.stat().st_size for p in paths)


def _is_dataset_name(spec: str) -> bool:
    """A `datasets` hub name: not an existing path, and not shaped like a file path."""
    return not require_path_or_name(spec, "--input")


def local_input_files(inputs: list[str]) -> list[Path]:
    """The files (and saved dataset directories) that the local ones of `inputs` name; hub names have none."""
    return [p for spec in inputs if not _is_dataset_name(spec) for p in expand_paths(spec, "--input")]


def _input_fingerprint(inputs: list[str], text_field: str, split: str, info: TokenizerInfo) -> str:
    """Identity of a prepare job: input files (path, size, mtime) or dataset fingerprints, text field, tokenizer."""
    parts = [f"tokenizer={info.id}", f"text_field={text_field}", f"split={split}"]
    for spec in inputs:
        if not _is_dataset_name(spec):
            for p in expand_paths(spec, "--input"):
                files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
                parts += [f"{q.resolve()}|{q.stat().st_size}|{q.stat().st_mtime_ns}" for q in files]
        else:
            parts.append(f"dataset={spec}|{getattr(load_hf(spec, split, None), '_fingerprint', '')}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def input_docs(inputs: list[str], text_field: str, split: str) -> Iterator[str]:
    for spec in inputs:
        if not _is_dataset_name(spec):
            yield from iter_docs(expand_paths(spec, "--input"), text_field, split)
        else:
            yield from dataset_docs(load_hf(spec, split, None), spec, text_field)


def prepare(
    inputs: list[str],
    output: str | Path,
    tokenizer: str,
    num_proc: int = 1,
    text_field: str = "text",
    split: str = "train",
    overwrite: bool = False,
    progress: bool = True,
    shard_tokens: int = 1 << 28,
) -> dict[str, Any]:
    """Tokenise `inputs` into `output`; a no-op when `output` already holds this exact job."""
    if not inputs:
        raise DataError("no --input given: pass at least one file, directory or dataset name.")
    if num_proc < 1:
        raise DataError(f"--num-proc={num_proc} must be at least 1.")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens={shard_tokens} must be a positive number of tokens per shard (at least 1).")
    out = Path(output).expanduser()
    info = load_tokenizer(tokenizer, key="--tokenizer")
    fingerprint = _input_fingerprint(inputs, text_field, split, info)
    meta_path = out / META
    old = None
    if meta_path.exists():
        old = _read_own_meta(meta_path)
        if old.get("fingerprint") == fingerprint:
            log.info("%s is up to date", out)
            return old
        if not overwrite:
            raise DataError(
                f"{out} already holds shards of other inputs or tokenizer: choose another --output or pass --overwrite."
            )
    meta = {"fingerprint": fingerprint, "inputs": [str(i) for i in inputs], "text_field": text_field}
    docs = input_docs(inputs, text_field, split)
    what = "--input " + " ".join(map(str, inputs))
    total = _plain_size(inputs) if progress else None
    return write_tokens(out, docs, info, meta, num_proc, progress, shard_tokens, what, total, replaces=old)


def _read_own_meta(path: Path) -> dict[str, Any]:
    """An earlier prepare's meta.json; anything else of that name is the user's, and stops the job."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or "fingerprint" not in meta or "shards" not in meta:
        raise DataError(
            f"{path} was not written by `optimus data prepare`: move it away or choose another --output "
            "(prepare never replaces files it did not write)."
        )
    return meta
