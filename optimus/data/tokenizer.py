"""Tokenizers: train a byte-level BPE, load one from a file or a Hugging Face name, identify it.

Everything downstream works on a `tokenizers.Tokenizer`; a Hugging Face
tokenizer is reduced to its fast backend. A tokenizer is identified by a hash
of its serialised form, so shards made with one tokenizer are recognised (and
refused) whatever name it was loaded under.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from optimus.data.errors import DataError
from optimus.data.sources import require_path_or_name

EOS_TOKEN = "<|endoftext|>"
# Names other tokenizers use for their end-of-document token, tried in order.
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")


@dataclass
class TokenizerInfo:
    tokenizer: Tokenizer
    name: str  # where it came from (file, HF name, "trained")
    id: str  # content hash of the serialised tokenizer
    vocab_size: int
    eos_id: int


def tokenizer_hash(tok: Tokenizer) -> str:
    return "sha256:" + hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


def describe(tok: Tokenizer, name: str, eos_token: str | None = None) -> TokenizerInfo:
    """Wrap `tok` with its identity, vocabulary size and end-of-document id."""
    candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
    eos_id = next((i for i in (tok.token_to_id(c) for c in candidates if c) if i is not None), None)
    if eos_id is None:
        raise DataError(
            f"tokenizer {name} has no end-of-document token (tried {', '.join(c for c in candidates if c)}): "
            f"use a tokenizer that defines one, e.g. train one with `optimus data tokenizer`."
        )
    return TokenizerInfo(tok, name, tokenizer_hash(tok), tok.get_vocab_size(with_added_tokens=True), eos_id)


def train_bpe(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with `EOS_TOKEN` as id 0; deterministic for the same documents in the same order."""
    if vocab_size < 257:
        raise DataError(f"vocab_size={vocab_size} is too small for a byte-level BPE: use at least 257.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    return tok


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> TokenizerInfo:
    """`spec` is a tokenizers JSON file, a directory holding tokenizer.json, or a Hugging Face name/path."""
    path = Path(spec).expanduser()
    require_path_or_name(spec, key)  # a mistyped path is not looked up on the Hub
    if path.is_dir() and (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            return describe(Tokenizer.from_file(str(path)), str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise DataError(f"{path} is not a tokenizers JSON file ({e}): pass a tokenizer.json or a HF name.") from e
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(
            f"{key}={spec!r} is neither a file nor a directory with tokenizer.json, and `transformers` is not "
            "installed to resolve it as a Hugging Face name: give a tokenizer.json path or `pip install transformers`."
        ) from None
    try:
        hf = AutoTokenizer.from_pretrained(spec, use_fast=True)
    except Exception as e:
        raise DataError(f"could not load tokenizer {spec!r} with transformers ({e}): check the name or path.") from e
    if not getattr(hf, "is_fast", False):
        raise DataError(f"tokenizer {spec!r} has no fast (tokenizers) version: convert it or use another tokenizer.")
    return describe(hf.backend_tokenizer, spec, hf.eos_token)


def encode_docs(tok: Tokenizer, docs: list[str]) -> list[list[int]]:
    """Token ids of each document, without special tokens added by a post-processor."""
    return [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
