"""Expert parallelism applied from outside the model: keep this rank's experts, install an EP dispatcher.

Experts are block-partitioned: EP rank j keeps global experts [j * E_local, (j + 1) * E_local)
with E_local = E / ep. The full model is built and initialised identically on every
rank first, so slicing gives each rank exactly the experts a single process would have.
"""

from __future__ import annotations

import torch.nn as nn

from optimus.config import ConfigError, ParallelConfig
from optimus.model.moe.allgather import AllGatherDispatcher
from optimus.model.moe.alltoall import AllToAllDispatcher
from optimus.model.moe.layer import MoE
from optimus.parallel.state import ParallelState

DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


def _keep_local_block(param: nn.Parameter, start: int, end: int) -> nn.Parameter:
    """A new parameter holding rows [start, end) of the expert dimension (a contiguous copy, not a view)."""
    return nn.Parameter(param.detach()[start:end].clone(), requires_grad=param.requires_grad)


def shard_experts(moe: MoE, ep: int, ep_rank: int) -> int:
    """Keep only EP rank `ep_rank`'s block of experts in `moe.experts`; returns the local expert count."""
    experts = moe.experts
    if experts.expert_offset != 0 or experts.n_experts != moe.router.n_experts:
        raise RuntimeError("apply_expert_parallel was called on a model whose experts are already sharded.")
    n_experts = experts.n_experts
    if n_experts % ep:
        raise ConfigError(
            f"model.moe.n_experts={n_experts} is not divisible by parallel.ep={ep}: choose an ep that divides it."
        )
    n_local = n_experts // ep
    start = ep_rank * n_local
    experts.w13 = _keep_local_block(experts.w13, start, start + n_local)
    experts.w2 = _keep_local_block(experts.w2, start, start + n_local)
    experts.n_experts = n_local
    experts.expert_offset = start
    return n_local


def apply_expert_parallel(model: nn.Module, ps: ParallelState, cfg: ParallelConfig) -> nn.Module:
    """Shard every MoE layer's experts over `ps.ep_group` and install `cfg.dispatcher`; modifies `model` in place."""
    if cfg.dispatcher not in DISPATCHERS:
        raise ConfigError(
            f"parallel.dispatcher={cfg.dispatcher!r} is not supported: set it to one of {', '.join(DISPATCHERS)}."
        )
    if ps.ep == 1:
        return model
    if ps.ep_group is None:
        raise RuntimeError("ParallelState has ep > 1 but no EP process group: build it with build_parallel_state.")
    moe_layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not moe_layers:
        raise ConfigError("parallel.ep > 1 needs a model with experts: set parallel.ep=1 for a dense model.")
    dispatcher_cls = DISPATCHERS[cfg.dispatcher]
    for moe in moe_layers:
        n_local = shard_experts(moe, ps.ep, ps.ep_rank)
        moe.dispatcher = dispatcher_cls(ps.ep_group, ps.ep, ps.ep_rank, n_local)
    return model
