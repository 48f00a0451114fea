"""Data pipeline: corpora, tokenizers, token shards and the deterministic batch loader.

Public entry points:
    build_data(cfg, seq_len, seed) -> DataBundle(train, val, vocab_size, tokenizer_id, eos_id, tokenizer)
    BatchLoader(dataset, global_batch, micro_batch, rank, world_size, seed, samples_consumed=0, prefetch=4)
    eval_batches(dataset, n, micro_batch, rank, world_size, seed=0), eval_set_size(dataset, n)
    prepare(inputs, output, tokenizer, num_proc=1, text_field="text")   (`optimus data prepare`)

The entry points are imported on first use: `optimus.cli` needs only DataError, and commands
such as `optimus plan` and `optimus launch` must not load `tokenizers` or `datasets`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from optimus.data.errors import DataError

# public name -> the module of optimus.data that defines it
_SUBMODULE = {
    "BatchLoader": "loader",
    "DataBundle": "build",
    "build_data": "build",
    "eval_batches": "loader",
    "eval_set_size": "loader",
    "load_tokenizer": "tokenizer",
    "open_tokens": "shards",
    "prepare": "prepare",
    "train_bpe": "tokenizer",
}

if TYPE_CHECKING:
    from optimus.data.build import DataBundle, build_data
    from optimus.data.loader import BatchLoader, eval_batches, eval_set_size
    from optimus.data.prepare import prepare
    from optimus.data.shards import open_tokens
    from optimus.data.tokenizer import load_tokenizer, train_bpe


def __getattr__(name: str):
    if name in _SUBMODULE:
        return getattr(importlib.import_module(f"optimus.data.{_SUBMODULE[name]}"), name)
    raise AttributeError(f"module 'optimus.data' has no attribute {name!r}")


__all__ = [
    "BatchLoader",
    "DataBundle",
    "DataError",
    "build_data",
    "eval_batches",
    "eval_set_size",
    "load_tokenizer",
    "open_tokens",
    "prepare",
    "train_bpe",
]
