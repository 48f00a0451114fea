"""`build_data`: turn a DataConfig into train/validation window datasets and tokenizer facts.

data=builtin, text and hf read documents into memory, tokenise them once into
a cache directory (keyed by a content hash of the corpus and the tokenizer),
and hold out whole documents chosen by a fixed hash for validation. data=tokens
memory-maps prepared directories and holds out the last documents of each.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from optimus.config import ConfigError, DataConfig
from optimus.data.cache import atomic_path, cache_root, locked
from optimus.data.errors import DataError
from optimus.data.order import permute
from optimus.data.prepare import write_tokens
from optimus.data.shards import META, TokenSource, TokenStream, fingerprint, open_tokens
from optimus.data.sources import dataset_docs, expand_paths, iter_docs, load_hf, stdlib_docs
from optimus.data.tokenizer import TokenizerInfo, describe, load_tokenizer, train_bpe
from optimus.data.windows import MixtureDataset, TokenWindows

log = logging.getLogger(__name__)
_VAL_KEY = (0x5EED, 0xDA7A)  # fixed: the held-out documents do not change with train.seed


@dataclass
class DataBundle:
    train: Any  # len(ds), ds[i] -> LongTensor [seq_len + 1], ds.gather(idx) -> [n, seq_len + 1]
    val: Any
    vocab_size: int
    tokenizer_id: str
    eos_id: int
    tokenizer: Tokenizer | None = None  # for decoding samples; None if the shards carry no tokenizer.json
    # What a resumed run must read again, recorded in each checkpoint (checkpoint_checks.run_identity):
    # data.tokens, the tokens' content (shards.fingerprint, whatever path names them), data.mix.weights, tokenizer.
    identity: dict[str, Any] = field(default_factory=dict)


def build_data(cfg: DataConfig, seq_len: int, seed: int) -> DataBundle:
    """Datasets of seq_len + 1 windows for `cfg`; `seed` is accepted for symmetry (the order lives in BatchLoader)."""
    del seed  # the split is fixed per corpus; sample order is seeded in BatchLoader
    if not 0 <= cfg.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction} must lie in [0, 1).")
    if cfg.name == "tokens":
        return _build_tokens(cfg, seq_len)
    if cfg.name == "builtin":
        docs = stdlib_docs(cfg.max_chars)
        if not docs:
            raise DataError("the Python standard library yielded no .py files: use data=text with your own files.")
    elif cfg.name == "text":
        docs = list(iter_docs(expand_paths(cfg.path), cfg.text_field))
    elif cfg.name == "hf":
        if not cfg.path:
            raise ConfigError("data.path is empty: set it to a datasets name or a local dataset path for data=hf.")
        ds = load_hf(str(cfg.path), cfg.hf_split, cfg.hf_config)
        docs = list(dataset_docs(ds, str(cfg.path), cfg.text_field))
    else:
        raise ConfigError(f"data={cfg.name!r} is not supported: set it to one of builtin, text, hf, tokens.")
    if not docs:
        raise DataError(f"data.path={cfg.path} holds no non-empty documents: point it at files with text.")
    source = _cached_corpus(cfg.name, docs, cfg.tokenizer, cfg.vocab_size)
    train, val = _split_by_hash(source, cfg.val_fraction, seq_len)
    return _bundle([source], TokenWindows(train, seq_len), TokenWindows(val, seq_len))


def _corpus_hash(docs: list[str]) -> str:
    h = hashlib.sha256()
    for doc in docs:
        raw = doc.encode("utf-8", "surrogatepass")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def _trained_tokenizer(docs: list[str], corpus: str, vocab_size: int) -> TokenizerInfo:
    """The BPE trained on this corpus, trained once and cached (safe when several ranks start together)."""
    path = cache_root() / "tokenizers" / f"bpe-{vocab_size}-{corpus[:24]}" / "tokenizer.json"
    with locked(path):
        if not path.is_file():
            log.info("training a %d-token BPE on %d documents (once; cached in %s)", vocab_size, len(docs), path.parent)
            tok = train_bpe(docs, vocab_size)
            with atomic_path(path) as tmp:
                tok.save(str(tmp))
    return describe(Tokenizer.from_file(str(path)), f"bpe-{vocab_size} trained on the corpus ({path})")


def _cached_corpus(kind: str, docs: list[str], tokenizer: str | None, vocab_size: int) -> TokenSource:
    corpus = _corpus_hash(docs)
    info = load_tokenizer(tokenizer) if tokenizer else _trained_tokenizer(docs, corpus, vocab_size)
    key = hashlib.sha256(f"{corpus}|{info.id}".encode()).hexdigest()[:24]
    out = cache_root() / "tokens" / f"{kind}-{key}"
    with locked(out):
        if not (out / META).is_file():
            log.info("tokenising %d documents into %s (once)", len(docs), out)
            write_tokens(out, docs, info, {"corpus_sha256": corpus, "kind": kind})
    return open_tokens(out)


def _split_by_hash(source: TokenSource, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out whole documents, taken in a fixed hashed order until they hold val_fraction of the tokens.

    A corpus of a single document (one .txt file) holds out the tail of its tokens instead.
    """
    ends = source.doc_ends
    starts = np.concatenate([[0], ends[:-1]])
    n_docs, total = len(ends), len(source.stream)
    need = max(val_fraction * total, seq_len + 1)
    if n_docs == 1 and val_fraction > 0:  # treat head and tail as two documents; hold out the tail
        cut = max(total - int(np.ceil(need)), 0)
        starts, ends, n_docs, order = np.array([0, cut]), np.array([cut, total]), 2, np.array([1])
    else:
        order = permute(np.arange(n_docs), n_docs, _VAL_KEY)
    val_docs = np.zeros(n_docs, dtype=bool)
    if val_fraction > 0:
        # Prefer documents of at most 1/16 of the held-out size, so the validation set is many
        # ordinary documents rather than one or two outliers (a large data table, a long docstring file).
        size_limit = max(need / 16, seq_len + 1)
        taken = 0
        for limit in (size_limit, np.inf):
            for d in order:
                if taken >= need or val_docs.sum() == n_docs - 1:
                    break
                if not val_docs[d] and ends[d] - starts[d] <= limit:
                    val_docs[d] = True
                    taken += int(ends[d] - starts[d])
    parts = [_concat_docs(source.stream, starts[sel], ends[sel]) for sel in (~val_docs, val_docs)]
    if len(parts[0]) < seq_len + 1:
        raise DataError(
            f"the corpus has {total} tokens, too few for a training window of train.seq_len + 1 = {seq_len + 1} tokens "
            "after holding out validation documents: add data (or raise data.max_chars) or lower train.seq_len."
        )
    return parts[0], parts[1]


def _concat_docs(stream: TokenStream, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    if not len(starts):
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([stream.read(int(a), int(b)) for a, b in zip(starts, ends, strict=True)])


def _bundle(sources: list[TokenSource], train: Any, val: Any, weights: list[float] | None = None) -> DataBundle:
    """The bundle of `sources` (read in this order, with these data.mix weights), described by the first."""
    first = sources[0]
    tok_file = first.directory / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
    prints = [fingerprint(s.meta) for s in sources]
    combined = prints[0] if len(prints) == 1 else "sha256:" + hashlib.sha256(" ".join(prints).encode()).hexdigest()[:16]
    n_tokens = sum(len(s.stream) for s in sources)
    identity = {"data.tokens": f"{combined} ({n_tokens} tokens)", "data.mix.weights": weights,
                "tokenizer": first.tokenizer_id}  # fmt: skip
    return DataBundle(train, val, first.vocab_size, first.tokenizer_id, first.eos_id, tok, identity)


# --- data=tokens -------------------------------------------------------------------------------


def _open_checked(directory: Any, expected: TokenizerInfo | None, spec: str | None) -> TokenSource:
    source = open_tokens(Path(str(directory)))
    if expected is not None and expected.id != source.tokenizer_id:
        raise DataError(
            f"the shards in {source.directory} were made with tokenizer {source.meta['tokenizer'].get('name')} "
            f"({source.tokenizer_id}) but data.tokenizer={spec} is {expected.id}: set data.tokenizer=null to use the "
            "shards' own tokenizer, or re-run `optimus data prepare` with this tokenizer."
        )
    return source


def _split_tail(source: TokenSource, val_fraction: float, seq_len: int) -> tuple[TokenStream, TokenStream]:
    """Train = all but the last documents; val = the last documents holding >= val_fraction of the tokens.

    When no document start leaves a training window before it (one long document), the tail of the
    tokens is held out instead, as for a single-document corpus in _split_by_hash.
    """
    total = len(source.stream)
    split = total
    if val_fraction > 0:
        need = int(np.ceil(max(val_fraction * total, seq_len + 1)))
        cut_points = np.concatenate([[0], source.doc_ends[:-1]])  # document starts
        fits = cut_points[cut_points <= total - need]
        split = int(fits[-1]) if len(fits) else 0
        if split < seq_len + 1:
            split = total - need
    if split < seq_len + 1:
        raise DataError(
            f"{source.directory} holds {total} tokens, too few for a training window of {seq_len + 1} tokens plus "
            f"{total - split} held-out tokens: prepare more data, lower data.val_fraction or lower train.seq_len."
        )
    return source.stream.slice(0, split), source.stream.slice(split, total)


def _mix_entries(cfg: DataConfig) -> list[tuple[Any, float]]:
    if cfg.mix is not None and cfg.path is not None:
        raise ConfigError("data.path and data.mix are both set: use data.path for one source or data.mix for several.")
    if cfg.mix is None:
        if cfg.path is None or cfg.path == "":
            raise ConfigError("data.path is empty: set it to a directory made by `optimus data prepare`.")
        paths = [cfg.path] if isinstance(cfg.path, str) else list(cfg.path)
        return [(p, 1.0) for p in paths]
    entries = []
    for i, item in enumerate(cfg.mix):
        if not isinstance(item, Mapping) or "path" not in item:
            raise ConfigError(f"data.mix[{i}]={item!r} must be a mapping like {{path: DIR, weight: 0.5}}.")
        try:
            weight = float(item.get("weight", 1.0))
        except (TypeError, ValueError):
            bad = item.get("weight")
            raise ConfigError(f"data.mix[{i}].weight={bad!r} is not a number: give a positive number.") from None
        if not weight > 0:  # also rejects nan
            raise ConfigError(f"data.mix[{i}].weight={weight} must be positive.")
        entries.append((item["path"], weight))
    if not entries:
        raise ConfigError("data.mix is empty: list at least one {path: DIR, weight: W}.")
    return entries


def _build_tokens(cfg: DataConfig, seq_len: int) -> DataBundle:
    entries = _mix_entries(cfg)
    expected = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    sources = [_open_checked(p, expected, cfg.tokenizer) for p, _ in entries]
    for s in sources[1:]:
        if s.tokenizer_id != sources[0].tokenizer_id:
            raise DataError(
                f"{s.directory} and {sources[0].directory} were made with different tokenizers: prepare every source "
                "of data.mix with the same tokenizer."
            )
    splits = [_split_tail(s, cfg.val_fraction, seq_len) for s in sources]
    if cfg.mix is None:  # one source, or a list of directories read back to back
        train = TokenWindows(TokenStream([p for t, _ in splits for p in t.pieces]), seq_len)
        val = TokenWindows(TokenStream([p for _, v in splits for p in v.pieces]), seq_len)
        return _bundle(sources, train, val)
    weights = [w for _, w in entries]
    train = MixtureDataset([TokenWindows(t, seq_len) for t, _ in splits], weights)
    val_parts = [TokenWindows(v, seq_len) for _, v in splits]
    val = MixtureDataset(val_parts, weights) if cfg.val_fraction > 0 else val_parts[0]  # empty when no split
    return _bundle(sources, train, val, weights)
