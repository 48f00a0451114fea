"""Datasets of training windows: packed token streams cut into seq_len + 1 windows, and weighted mixtures."""

from __future__ import annotations

import numpy as np
import torch

from optimus.data.errors import DataError
from optimus.data.order import permute
from optimus.data.shards import TokenStream


class TokenWindows:
    """Window i is tokens[i*S : i*S + S + 1] of the packed stream (consecutive windows share one token)."""

    def __init__(self, stream: TokenStream | np.ndarray, seq_len: int):
        self.stream = stream if isinstance(stream, TokenStream) else TokenStream([stream])
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        return torch.from_numpy(self.stream.read(start, start + self.seq_len + 1).astype(np.int64))  # [S + 1]

    def gather(self, idx: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.stream.gather(np.asarray(idx) * self.seq_len, self.seq_len + 1))  # [n, S + 1]


def _split_counts(total: int, weights: np.ndarray) -> np.ndarray:
    """Integer counts proportional to `weights` summing to `total` (largest remainder, ties to the first)."""
    raw = total * weights / weights.sum()
    counts = np.floor(raw).astype(np.int64)
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[: total - counts.sum()]] += 1
    return counts


class MixtureDataset:
    """Windows of several sources drawn in fixed proportions.

    Indices address the concatenation of the sources. One epoch has len(self)
    samples: exactly round(len * w_s) from source s, spread by a seeded
    permutation; a source asked for more samples than it has repeats, with a
    fresh permutation for each repetition and each epoch.
    """

    def __init__(self, parts: list, weights: list[float]):
        self.parts, self.weights = parts, np.asarray(weights, dtype=np.float64)
        if any(len(p) == 0 for p in parts):
            raise DataError("a data.mix source has no complete window: give it more data or lower train.seq_len.")
        self.offsets = np.cumsum([0] + [len(p) for p in parts])  # [n_parts + 1]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, i: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, i, side="right") - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        part = int(self._locate(np.asarray([i]))[0])
        return self.parts[part][i - int(self.offsets[part])]

    def gather(self, idx: np.ndarray) -> torch.Tensor:
        idx = np.asarray(idx, dtype=np.int64)
        parts = self._locate(idx)
        out = None
        for p in np.unique(parts):
            sel = parts == p
            rows = self.parts[p].gather(idx[sel] - self.offsets[p])  # [n_p, S + 1]
            if out is None:
                out = torch.empty(len(idx), rows.shape[1], dtype=rows.dtype)
            out[torch.from_numpy(np.flatnonzero(sel))] = rows
        return out

    def epoch_indices(self, seed: int, epoch: int, within: np.ndarray) -> np.ndarray:
        """Concatenated indices of the samples at positions `within` of `epoch`."""
        counts = _split_counts(len(self), self.weights)
        bounds = np.cumsum(np.concatenate([[0], counts]))
        slot = permute(within, len(self), (seed, epoch, 0))  # which of the epoch's draws this position gets
        source = np.searchsorted(bounds, slot, side="right") - 1
        draw = slot - bounds[source]  # k-th draw from its source
        out = np.empty_like(slot)
        for s in np.unique(source):
            n_s = len(self.parts[s])
            sel = source == s
            rep, k = draw[sel] // n_s, draw[sel] % n_s
            res = np.empty_like(k)
            for r in np.unique(rep):
                res[rep == r] = permute(k[rep == r], n_s, (seed, epoch, 1 + int(s), int(r)))
            out[sel] = res + self.offsets[s]
        return out
