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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from optimus.data.errors import DataError
from optimus.data.shards import META, ShardWriter, remove_token_files
from optimus.data.sources import dataset_docs, expand_paths, iter_docs, load_hf
from optimus.data.tokenizer import TokenizerInfo, encode_docs, load_tokenizer

log = logging.getLogger(__name__)
_CHUNK_CHARS = 1 << 20  # text per unit of work handed to a process
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
) -> dict[str, Any]:
    """Encode `docs` (each followed by EOS) into shards in `out_dir`; meta.json is written last."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob(".shard_*"), *out_dir.glob("shard_*")]:  # leftovers of an unfinished run
        stale.unlink()
    info.tokenizer.save(str(out_dir / "tokenizer.json"))
    writer = ShardWriter(out_dir, info.vocab_size, info.eos_id, shard_tokens)
    bar, bar_docs = _progress_bar(progress, total_bytes), [0]  # documents written so far
    chunks = _chunks(docs)
    if num_proc > 1:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, and no warning after fork
        try:
            with ctx.Pool(num_proc, initializer=_init_worker, initargs=(info.tokenizer.to_str(),)) as pool:
                for ids, nbytes in pool.imap(_encode_chunk, chunks):
                    writer.add(ids)
                    bar_docs[0] += len(ids)
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
            bar_docs[0] += len(chunk)
            if bar is not None:
                bar.update(sum(len(d.encode()) for d in chunk))
    if bar is not None:
        bar.close()
    if not bar_docs[0]:
        raise DataError(f"{describe_inputs} has no non-empty documents: point the input at files with text.")
    tok_meta = {"id": info.id, "name": info.name, "vocab_size": info.vocab_size, "eos_id": info.eos_id}
    return writer.finish({**extra_meta, "tokenizer": tok_meta})


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
    path = Path(spec).expanduser()
    if path.exists():
        return False
    if path.is_absolute() or spec.startswith(".") or path.suffix or spec.count("/") > 1:
        raise DataError(f"--input {spec} does not exist: check the path.")
    return True


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
    out = Path(output).expanduser()
    info = load_tokenizer(tokenizer, key="--tokenizer")
    fingerprint = _input_fingerprint(inputs, text_field, split, info)
    meta_path = out / META
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if old.get("fingerprint") == fingerprint:
            log.info("%s is up to date", out)
            return old
        if not overwrite:
            raise DataError(
                f"{out} already holds shards of other inputs or tokenizer: choose another --output or pass --overwrite."
            )
        meta_path.unlink()  # untrusted from here on, until the new metadata is written
        remove_token_files(out)  # only prepare's own files: the folder may hold the user's
    meta = {"fingerprint": fingerprint, "inputs": [str(i) for i in inputs], "text_field": text_field}
    docs = input_docs(inputs, text_field, split)
    what = "--input " + " ".join(map(str, inputs))
    total = _plain_size(inputs) if progress else None
    return write_tokens(out, docs, info, meta, num_proc, progress, shard_tokens, what, total)
