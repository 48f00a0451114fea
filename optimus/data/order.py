"""The global sample order: a seeded permutation of all windows, drawn again each epoch.

The permutation is a keyed Feistel network with cycle-walking, so the sample at
any global position is computed directly in O(1) memory, even for billions of
windows, and depends only on (seed, epoch) and the dataset — never on rank or
world size.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a cheap, well-mixed hash of uint64 values."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def permute(i: np.ndarray, n: int, key: tuple[int, ...]) -> np.ndarray:
    """Image of indices `i` (all < n) under a bijection of [0, n) chosen by `key`."""
    i = np.asarray(i, dtype=np.uint64)
    if n <= 1:
        return i.astype(np.int64)
    half = ((n - 1).bit_length() + 1) // 2  # the Feistel domain 4**half is < 4n, so cycle-walking is short
    mask = np.uint64((1 << half) - 1)
    keys = np.random.SeedSequence(list(key)).generate_state(_ROUNDS, np.uint64)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    out = encrypt(i)
    while (outside := out >= np.uint64(n)).any():  # walk the cycle until it re-enters [0, n)
        out[outside] = encrypt(out[outside])
    return out.astype(np.int64)


def global_indices(dataset: object, seed: int, positions: np.ndarray) -> np.ndarray:
    """Dataset indices of global sample `positions` (which run past len(dataset) into later epochs)."""
    n = len(dataset)
    positions = np.asarray(positions, dtype=np.int64)
    epochs, within = positions // n, positions % n
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        if hasattr(dataset, "epoch_indices"):  # a mixture decides its own order
            out[sel] = dataset.epoch_indices(seed, int(epoch), within[sel])
        else:
            out[sel] = permute(within[sel], n, (seed, int(epoch)))
    return out
