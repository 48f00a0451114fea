"""Parameter dtypes of a run: bf16 runs store bf16 parameters; the optimizer keeps their fp32 master copy.

`train.dtype=auto` is resolved per device by optimus.platform.resolve_dtype.
"""

from __future__ import annotations

import torch

from optimus.config import TORCH_DTYPES


def param_dtype(dtype: str) -> torch.dtype:
    """Parameter dtype of a resolved `train.dtype`: bf16 runs keep bf16 parameters (fp32 master in the optimizer)."""
    return TORCH_DTYPES[dtype]


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Store every floating-point parameter in `dtype`; buffers (RoPE tables, router bias) keep their precision."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
