"""Data pipeline: corpora, tokenizers, token shards and the deterministic batch loader.

Public entry points:
    build_data(cfg, seq_len, seed) -> DataBundle(train, val, vocab_size, tokenizer_id, eos_id, tokenizer)
    BatchLoader(dataset, global_batch, micro_batch, rank, world_size, seed, samples_consumed=0, prefetch=4)
    eval_batches(dataset, n, micro_batch, rank, world_size, seed=0)
    prepare(inputs, output, tokenizer, num_proc=1, text_field="text")   (`optimus data prepare`)
"""

from optimus.data.build import DataBundle, build_data
from optimus.data.errors import DataError
from optimus.data.loader import BatchLoader, eval_batches
from optimus.data.prepare import prepare
from optimus.data.shards import open_tokens
from optimus.data.tokenizer import load_tokenizer, train_bpe

__all__ = [
    "BatchLoader",
    "DataBundle",
    "DataError",
    "build_data",
    "eval_batches",
    "load_tokenizer",
    "open_tokens",
    "prepare",
    "train_bpe",
]
