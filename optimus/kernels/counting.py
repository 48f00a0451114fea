"""How many of a list of ids fall on each of n values, without a host synchronisation.

`torch.bincount` sizes its output by the largest id, so on a GPU it reads the ids' minimum and maximum back
to the host before it launches (a stall of the launch queue per call, one per MoE layer and micro-batch in
the router alone), and on shape-only (fake) tensors it cannot run at all. The number of values is always
known here (experts, tokens), so a scatter-add into a zeroed [n] tensor gives the same counts with a shape
fixed in advance.
"""

from __future__ import annotations

import torch


def count_ids(ids_A: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64: element v counts the entries of `ids_A` (int64, each in [0, n)) equal to v."""
    counts_N = torch.zeros(n, dtype=torch.int64, device=ids_A.device)
    return counts_N.scatter_add_(0, ids_A.reshape(-1), torch.ones_like(ids_A.reshape(-1), dtype=torch.int64))
