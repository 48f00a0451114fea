"""Where a run of optimizer state sits in its parameter, in coordinates that do not depend on the layout.

Optimizer state is kept, saved and loaded in runs of consecutive elements of what a rank holds.
Without tensor parallelism a rank holds whole parameters (or whole experts), so a run is a range
[lo, hi) of the whole parameter flattened. Tensor parallelism can give a rank a block of columns
of a matrix (RowwiseParallel's weights, split along dim 1): a run of that block is not a range of
the whole matrix. So a run is named by (lo, hi, cols): elements [lo, hi) of the block of columns
[cols[0], cols[1]) flattened row by row, cols = None meaning all columns. A parameter is seen as
a matrix [shape[0], rest] (a vector as one row), and a run covers at most three rectangles of it:
the end of its first row, whole rows, the start of its last row. Two runs from any two layouts
overlap in rectangles, copied between them with strided views; `copy_overlap` is the one place
that does it (the optimizer's load, the checkpoint's choice of what to read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateRange:
    lo: int
    hi: int
    shape: tuple[int, ...]  # the whole parameter's (routed experts: all E of them)
    cols: tuple[int, int] | None = None  # a block of columns of the matrix view; None = all of them

    @property
    def n_cols(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else math.prod(self.shape)

    @property
    def block(self) -> tuple[int, int]:
        return self.cols or (0, self.n_cols)

    def rectangles(self) -> list[tuple[int, int, int, int]]:
        """(row_lo, row_hi, col_lo, col_hi) in the matrix view: the cells this run covers."""
        a, b = self.block
        width = b - a
        first_row, last_row = self.lo // width, (self.hi - 1) // width
        start, end = self.lo - first_row * width, self.hi - last_row * width  # columns within the block
        if first_row == last_row:
            return [(first_row, first_row + 1, a + start, a + end)]
        rects = [(first_row, first_row + 1, a + start, b)]
        if last_row > first_row + 1:
            rects.append((first_row + 1, last_row, a, b))
        rects.append((last_row, last_row + 1, a, a + end))
        return rects

    def view(self, flat: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """The cells rows x cols (inside this run) of `flat`, this run's values [hi - lo], as a strided view."""
        a, b = self.block
        offset = rows[0] * (b - a) + cols[0] - a - self.lo
        return flat.as_strided((rows[1] - rows[0], cols[1] - cols[0]), (b - a, 1), flat.storage_offset() + offset)


def range_key(name: str, lo: int, hi: int, cols: tuple[int, int] | None) -> str:
    """How a run is named in state dicts and checkpoints: "name[lo:hi]", or "name[lo:hi]@cols[a:b]"."""
    return f"{name}[{lo}:{hi}]" + (f"@cols[{cols[0]}:{cols[1]}]" if cols else "")


def overlaps(dst: StateRange, src: StateRange) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (rows, cols) rectangles that both runs cover."""
    out = []
    for r0, r1, c0, c1 in dst.rectangles():
        for s0, s1, d0, d1 in src.rectangles():
            rows, cols = (max(r0, s0), min(r1, s1)), (max(c0, d0), min(c1, d1))
            if rows[0] < rows[1] and cols[0] < cols[1]:
                out.append((rows, cols))
    return out


def covered(dst: StateRange, src: StateRange) -> int:
    """How many of `dst`'s elements `src` holds."""
    return sum((r[1] - r[0]) * (c[1] - c[0]) for r, c in overlaps(dst, src))


def copy_overlap(dst_flat: torch.Tensor, dst: StateRange, src_flat: torch.Tensor, src: StateRange) -> int:
    """Copy the elements `src` shares with `dst` from `src_flat` into `dst_flat`; returns how many."""
    n = 0
    for rows, cols in overlaps(dst, src):
        dst.view(dst_flat, rows, cols).copy_(src.view(src_flat, rows, cols))
        n += (rows[1] - rows[0]) * (cols[1] - cols[0])
    return n
