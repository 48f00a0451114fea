"""The kernels' reads of values back to the host, and how a dry run answers them.

Two CPU paths need host integers: a per-expert loop needs each expert's row bounds, and the CPU combine its
tokens' first rows. On fake tensors (`optimus plan --dry-run`) there are no values to read; while
`shape_only(on_read)` is active each read is answered from shapes alone, as the dry run's load model
implies (optimus.load_model): a rank's rows spread evenly over its experts, and every token holds the same
number of rows (dropless routing: top_k each). `on_read()` is called for each, so the dry run counts it as
the host synchronisation it stands for. The kernels import nothing else of Optimus: the dry run plugs in here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_on_read: list[Callable[[], None]] = []  # non-empty while a dry run answers the reads


@contextmanager
def shape_only(on_read: Callable[[], None]) -> Iterator[None]:
    """Answer the kernels' reads from shapes until the block ends, calling `on_read()` for each."""
    _on_read.append(on_read)
    try:
        yield
    finally:
        _on_read.remove(on_read)


def _answered() -> bool:
    if not _on_read:
        return False
    _on_read[-1]()
    return True


def _even_split(n: int, parts: int) -> list[int]:
    return [n * (i + 1) // parts - n * i // parts for i in range(parts)]


def group_bounds(offsets_G: torch.Tensor, n_rows: int) -> list[int]:
    """[0, offsets...] as host integers (`offsets_G`: each group's end row, `n_rows` in all): one host sync."""
    if _answered():
        counts = _even_split(n_rows, offsets_G.shape[0])
        return [0] + [sum(counts[: g + 1]) for g in range(len(counts))]
    return [0] + offsets_G.tolist()


def token_row_starts(crow_starts: torch.Tensor, token_starts: list[int], n_rows: int, n_tokens: int) -> list[int]:
    """The first row of each token in `token_starts` as host integers (`crow_starts`: those rows, read from a CSR
    row index over `n_rows` rows of `n_tokens` tokens)."""
    if _answered():
        return [t * n_rows // n_tokens for t in token_starts]
    return crow_starts.tolist()
