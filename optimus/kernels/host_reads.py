"""The kernels' reads of values back to the host, and how a dry run answers them.

A per-expert loop needs each expert's row bounds as host integers. On fake tensors (`optimus plan --dry-run`)
there are no values to read: the dry run hands the kernels a `RowReads` (through optimus.kernels.get_backend),
which answers each read from shapes alone, as its load model implies (optimus.load_model): a rank's rows over
its experts as `split(rows, experts)` gives them (evenly by default). `on_read()` is called for each, so the dry
run counts it as the host synchronisation it stands for. The kernels import nothing else of Optimus: the dry
run plugs in here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def even_split(n: int, parts: int) -> list[int]:
    """`n` rows over `parts` groups as evenly as integers allow."""
    return [n * (i + 1) // parts - n * i // parts for i in range(parts)]


Split = Callable[[int, int], list[int]]  # (rows, groups) -> rows of each group


@dataclass(frozen=True)
class RowReads:
    """How a dry run answers the kernels' reads, handed to the kernels by what builds the step: `on_read()` counts
    each read as the host synchronisation it stands for, and `split(rows, groups)` gives a rank's rows over its
    experts."""

    on_read: Callable[[], None]
    split: Split = even_split


def _bounds(counts: list[int]) -> list[int]:
    return [0] + [sum(counts[: g + 1]) for g in range(len(counts))]


def group_bounds(offsets_G: torch.Tensor, n_rows: int, reads: RowReads | None = None) -> list[int]:
    """[0, offsets...] as host integers (`offsets_G`: each group's end row, `n_rows` in all): one host sync; with
    a dry run's `reads`, answered from shapes."""
    if reads is not None:
        reads.on_read()
        return _bounds(reads.split(n_rows, offsets_G.shape[0]))
    return [0] + offsets_G.tolist()


def assumed_bounds(n_rows: int, n_groups: int, reads: RowReads | None = None) -> list[int]:
    """group_bounds as a dry run's `reads` answer it (an even split without), for fake tensors only and without
    counting a read: the bounds a stand-in for a kernel that reads nothing back loops over."""
    return _bounds((reads.split if reads is not None else even_split)(n_rows, n_groups))
