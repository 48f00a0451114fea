"""Check at start that the kernels the model will call (the expert path's, the RMSNorms') compute correctly here.

A kernel that is wrong on one device (a compiler bug, a tile that drops a row, a weight read with the wrong
strides) does not crash: it trains on wrong numbers. Before step 1 every rank runs each kernel of the backend
the model takes (`kernels`, resolved as the model resolves it) forward and backward once, on one small case at
the model's own widths and this rank's experts (a dense model: its RMSNorms' kernels alone, at its width), in
the run's compute dtype on the run's device, against the plain-PyTorch reference (`optimus.kernels.check`,
which also holds the tolerance rule). The real widths are what a kernel's tiling sees in the step; Triton's
autotuning, which keys on the widths alone, is forgotten after the check, so that the step's first micro-batch
tunes at its own row count.

The ranks then agree (one all-reduce of the errors over the world, MAX) and every rank raises the same
one-sentence `KernelCheckFailed` naming the first failing kernel, or none does. `check_kernels` switches it:
null (the default) runs it on every device but a CPU, true also on a CPU, false never.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from optimus.config import ConfigError, ModelConfig, OptimusConfig
from optimus.kernels import KernelUnavailable, get_backend
from optimus.kernels.check import Case, check_backend, first_failure
from optimus.layout import experts_per_rank
from optimus.model import moe_layer_ids
from optimus.parallel.state import ParallelState

# Tokens of the case: with top_k rows each, a few row tiles of the GPU kernels (64 to 256 rows), so that tiles
# follow one another and straddle expert boundaries, and the check takes well under a second on a GPU.
TOKENS = 96


class KernelCheckFailed(ConfigError):
    """A kernel computed wrong values on this device: the run stops before step 1, and the fix is a setting
    (another backend), so it is reported like a config error, in one sentence."""


def kernel_check_enabled(setting: bool | None, device_type: str) -> bool:
    """`check_kernels`: null = on for every device but a CPU (whose torch kernels the test suite covers)."""
    return device_type != "cpu" if setting is None else setting


def startup_case(model: ModelConfig, ep: int) -> Case:
    """The one shape checked: `TOKENS` tokens at the model's widths over this rank's experts (n_experts / ep),
    one of them without rows when top_k leaves one free; for a model without MoE layers, `TOKENS` rows of its
    width (and a token expert path that check_kernels does not run)."""
    if not moe_layer_ids(model):
        return Case(f"{TOKENS} tokens", TOKENS, model.dim, 1, 1, 1)
    moe = model.moe
    experts = experts_per_rank(moe.n_experts, ep)
    top_k = min(moe.top_k, experts)  # a token's rows on one rank: at most one per local expert
    empty = (experts // 2,) if experts > top_k else ()  # in the middle, where a tile walk steps over it
    return Case(f"{TOKENS} tokens", TOKENS, model.dim, moe.expert_dim, experts, top_k, empty_experts=empty)


def check_kernels(cfg: OptimusConfig, ps: ParallelState, device: torch.device, compute_dtype: torch.dtype) -> None:
    """Run every kernel of the backend `cfg.kernels` resolves to on `startup_case`; all ranks raise the first
    failure, or none does."""
    case = startup_case(cfg.model, ps.ep)
    try:
        backend = get_backend(cfg.kernels, device.type)
    except KernelUnavailable as err:  # the `kernels` key: the user's to change, as the model reports it
        raise ConfigError(str(err)) from None
    dense = not moe_layer_ids(cfg.model)
    results = check_backend(backend, [case], [compute_dtype], device, dense_only=dense)
    if backend.name == "triton":  # tuned on the case's few rows: let the step's first micro-batch tune its own
        from optimus.kernels.triton_kernels import forget_autotuning

        forget_autotuning()
    # Each kernel's worst error over the ranks: every rank then reports the same kernel with the same number.
    error_K = torch.tensor([r.error for r in results], dtype=torch.float64, device=device)
    if ps.is_distributed:
        dist.all_reduce(error_K, op=dist.ReduceOp.MAX)
    agreed = [dataclasses.replace(r, error=e) for r, e in zip(results, error_K.tolist())]
    failed = first_failure(agreed)
    if failed is not None:
        sentence = failed.failure(backend.name).removesuffix(".")
        raise KernelCheckFailed(f"At start-up, {sentence}, or set check_kernels=false to train anyway.")
