"""Deterministic, layout-invariant batch loading with background prefetch.

Global sample position p holds dataset item `global_indices(ds, seed, [p])`.
Global batch g is positions [g*GB, (g+1)*GB), cut in order into GB/mb
micro-batches; rank r of W takes micro-batches [r*A, (r+1)*A) with
A = GB/(mb*W). The micro-batches of a step are therefore the same for every
world size, and a single process accumulating over all of them sees exactly
what W ranks see together.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np
import torch

from optimus.data.errors import DataError
from optimus.data.order import global_indices
from optimus.layout import micro_batches_per_rank


def _gather(dataset: Any, idx: np.ndarray) -> torch.Tensor:
    if hasattr(dataset, "gather"):
        return dataset.gather(idx)
    return torch.stack([torch.as_tensor(dataset[int(i)]) for i in idx])


def rank_micro_batches(
    dataset: Any, seed: int, first: int, global_batch: int, micro_batch: int, rank: int, world_size: int
) -> list[torch.Tensor]:
    """This rank's micro-batches of the global batch starting at global position `first`."""
    accum = micro_batches_per_rank(global_batch, micro_batch, world_size)
    start = first + rank * accum * micro_batch
    idx = global_indices(dataset, seed, np.arange(start, start + accum * micro_batch))
    rows = _gather(dataset, idx)  # [accum * mb, S + 1]
    return list(rows.view(accum, micro_batch, -1).unbind(0))  # accum x [mb, S + 1]


class BatchLoader:
    """Yields this rank's micro-batches of each optimizer step; a thread prepares up to `prefetch` steps ahead."""

    def __init__(
        self,
        dataset: Any,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        samples_consumed: int = 0,
        prefetch: int = 4,
        pin_memory: bool = False,
    ):
        """`pin_memory`: the micro-batches go to an accelerator; page-locked, they can be copied asynchronously."""
        micro_batches_per_rank(global_batch, micro_batch, world_size)  # refuses a batch the ranks cannot share
        if len(dataset) == 0:
            raise DataError("the dataset has no window of seq_len + 1 tokens: add data or lower train.seq_len.")
        self.dataset, self.global_batch, self.micro_batch = dataset, global_batch, micro_batch
        self.rank, self.world_size, self.seed, self.prefetch = rank, world_size, seed, prefetch
        self.pin = pin_memory
        self._thread: threading.Thread | None = None
        self._start(samples_consumed)

    def _make(self, first: int) -> list[torch.Tensor]:
        mbs = rank_micro_batches(
            self.dataset, self.seed, first, self.global_batch, self.micro_batch, self.rank, self.world_size
        )
        return [m.pin_memory() for m in mbs] if self.pin else mbs

    def _start(self, samples_consumed: int) -> None:
        self._consumed = samples_consumed
        if self.prefetch <= 0:
            return
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._run, args=(samples_consumed,), daemon=True, name="optimus-data")
        self._thread.start()

    def _run(self, first: int) -> None:
        while not self._stop.is_set():
            try:
                item: Any = self._make(first)
            except BaseException as e:  # handed to the consumer, which raises it
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            first += self.global_batch

    def next_step(self) -> list[torch.Tensor]:
        """This rank's micro-batches of the next step: global_batch // (micro_batch * world_size) x [mb, S + 1]."""
        if self._thread is None:
            item = self._make(self._consumed)
        else:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
        self._consumed += self.global_batch
        return item

    def state_dict(self) -> dict[str, int]:
        return {"samples_consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.close()
        self._start(int(state["samples_consumed"]))

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def eval_set_size(dataset: Any, n_sequences: int) -> int:
    """How many windows the held-out set has: the first `n_sequences` of `dataset`, or all of them when it has
    fewer (train.eval_sequences is an upper bound: the run says how many it used)."""
    if len(dataset) == 0:
        raise DataError("the validation set has no complete window: raise data.val_fraction or lower train.seq_len.")
    return min(n_sequences, len(dataset))


def eval_batches(
    dataset: Any, n_sequences: int, micro_batch: int, rank: int, world_size: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the held-out set: (tokens [mb, S + 1], weight [mb]) micro-batches.

    The held-out set is the first n = eval_set_size(dataset, n_sequences) windows of
    `dataset` in its seed-`seed` order, whatever the layout. Rank r takes the contiguous block
    [r * P, (r + 1) * P) of them, P = ceil(n / W). Every rank runs the same number of
    full micro-batches (expert-parallel collectives need both), so the last ones are
    padded with rows of weight 0; a loss weighted by `weight` and divided by n x S
    is then the same mean for every world size and micro-batch.
    """
    n = eval_set_size(dataset, n_sequences)
    per_rank = -(-n // world_size)
    n_batches = -(-per_rank // micro_batch)
    lo, hi = min(n, rank * per_rank), min(n, (rank + 1) * per_rank)
    n_pad = n_batches * micro_batch - (hi - lo)
    positions = np.concatenate([np.arange(lo, hi), np.zeros(n_pad, dtype=np.int64)])  # padding repeats window 0
    rows = _gather(dataset, global_indices(dataset, seed, positions))  # [n_batches * mb, S + 1]
    weight = torch.cat([torch.ones(hi - lo), torch.zeros(n_pad)])  # [n_batches * mb]
    return list(zip(rows.view(n_batches, micro_batch, -1).unbind(0), weight.view(n_batches, micro_batch).unbind(0)))
