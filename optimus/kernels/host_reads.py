"""The kernels' reads of values back to the host, and how a dry run answers them.

Two CPU paths need host integers: a per-expert loop needs each expert's row bounds, and the CPU combine its
tokens' first rows. On fake tensors (`optimus plan --dry-run`) there are no values to read; while
`shape_only(on_read, split)` is active each read is answered from shapes alone, as the dry run's load model
implies (optimus.load_model): a rank's rows over its experts as `split(rows, experts)` gives them (evenly by
default), and every token holds the same number of rows (dropless routing: top_k each). `on_read()` is called
for each, so the dry run counts it as the host synchronisation it stands for. The kernels import nothing else
of Optimus: the dry run plugs in here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def even_split(n: int, parts: int) -> list[int]:
    """`n` rows over `parts` groups as evenly as integers allow."""
    return [n * (i + 1) // parts - n * i // parts for i in range(parts)]


Split = Callable[[int, int], list[int]]  # (rows, groups) -> rows of each group
# While a dry run answers the reads: its (on_read, split), the innermost last.
_answering: list[tuple[Callable[[], None], Split]] = []


@contextmanager
def shape_only(on_read: Callable[[], None], split: Split = even_split) -> Iterator[None]:
    """Answer the kernels' reads from shapes until the block ends, calling `on_read()` for each; a rank's
    rows over its experts as `split(rows, experts)` gives them."""
    entry = (on_read, split)
    _answering.append(entry)
    try:
        yield
    finally:
        _answering.remove(entry)


def _answered() -> Split | None:
    """The split a dry run answers with (after counting the read), or None outside one."""
    if not _answering:
        return None
    on_read, split = _answering[-1]
    on_read()
    return split


def _bounds(counts: list[int]) -> list[int]:
    return [0] + [sum(counts[: g + 1]) for g in range(len(counts))]


def group_bounds(offsets_G: torch.Tensor, n_rows: int) -> list[int]:
    """[0, offsets...] as host integers (`offsets_G`: each group's end row, `n_rows` in all): one host sync."""
    split = _answered()
    if split is not None:
        return _bounds(split(n_rows, offsets_G.shape[0]))
    return [0] + offsets_G.tolist()


def assumed_bounds(n_rows: int, n_groups: int) -> list[int]:
    """group_bounds as a dry run's load model answers it (an even split outside a dry run), for fake tensors
    only and without counting a read: the bounds a stand-in for a kernel that reads nothing back loops over."""
    split = _answering[-1][1] if _answering else even_split
    return _bounds(split(n_rows, n_groups))


def token_row_starts(crow_starts: torch.Tensor, token_starts: list[int], n_rows: int, n_tokens: int) -> list[int]:
    """The first row of each token in `token_starts` as host integers (`crow_starts`: those rows, read from a CSR
    row index over `n_rows` rows of `n_tokens` tokens)."""
    if _answered() is not None:
        return [t * n_rows // n_tokens for t in token_starts]
    return crow_starts.tolist()
