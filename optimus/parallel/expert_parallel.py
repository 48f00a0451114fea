"""Expert parallelism applied from outside the model: keep this rank's experts, install an EP dispatcher.

Experts are block-partitioned: EP rank j keeps global experts [j * E_local, (j + 1) * E_local)
with E_local = E / ep. `parallelize` slices a model still on the meta device (free), a library
user's model is sliced after it was built whole; either way a rank holds exactly the values a
single process would have, since initial values depend on the global expert index only
(optimus.model.init).
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from optimus.config import ParallelConfig
from optimus.errors import check_choice
from optimus.layout import expert_range, experts_per_rank
from optimus.model.moe.layer import MoE
from optimus.parallel.allgather_dispatch import AllGatherDispatcher
from optimus.parallel.alltoall_dispatch import AllToAllDispatcher
from optimus.parallel.state import ParallelState

# The values of parallel.dispatcher, and what each is.
DISPATCHER_CLASSES = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


def dispatcher_class(name: str) -> type[AllToAllDispatcher | AllGatherDispatcher]:
    """The EP dispatcher parallel.dispatcher=`name` asks for; refused in one sentence when none has that name."""
    check_choice(name, "parallel.dispatcher", tuple(DISPATCHER_CLASSES))
    return DISPATCHER_CLASSES[name]


def shard_experts(moe: MoE, ep: int, ep_rank: int) -> int:
    """Keep only EP rank `ep_rank`'s block of experts in `moe.experts`; returns the local expert count.

    A layer that already holds exactly that block is left as is.
    """
    experts = moe.experts
    start, end = expert_range(moe.router.n_experts, ep, ep_rank)
    if (experts.expert_offset, experts.n_experts) == (start, end - start):
        return end - start
    if experts.expert_offset != 0 or experts.n_experts != moe.router.n_experts:
        raise RuntimeError(
            f"This model holds experts [{experts.expert_offset}, {experts.expert_offset + experts.n_experts}), "
            f"neither all of them nor EP rank {ep_rank}'s block [{start}, {end})."
        )
    experts.keep_experts(start, end)
    return end - start


def apply_expert_parallel(
    model: nn.Module, ps: ParallelState, cfg: ParallelConfig, equal_tokens: bool = False, timers=None, answers=None
) -> nn.Module:
    """Shard every MoE layer's experts over `ps.ep_group` and install `cfg.dispatcher`; modifies `model` in place.

    `equal_tokens`: the caller guarantees that every EP rank brings the same number of tokens to each call
    (the trainer does: one micro-batch shape on every rank, optimus.config_checks.validate). The all-gather
    dispatcher then skips its per-call check, a blocking all-gather of the counts and a host sync.
    `timers` (profile.timers): the dispatchers time their exchanges with it. `answers`: a dry run's
    optimus.load_model.LoadAnswers, which answer the dispatchers' value reads (None: a real step)."""
    dispatcher_cls = dispatcher_class(cfg.dispatcher)
    if ps.ep == 1:
        return model
    if ps.ep_group is None:
        raise RuntimeError("ParallelState has ep > 1 but no EP process group: build it with build_parallel_state.")
    moe_layers = [m for m in model.modules() if isinstance(m, MoE)]
    # validate() has checked that only the all-to-all dispatcher is asked for chunks.
    options = {"chunks": cfg.ep_overlap_chunks} if cfg.dispatcher == "alltoall" else {"check_tokens": not equal_tokens}
    for moe in moe_layers:
        n_local = shard_experts(moe, ps.ep, ps.ep_rank)
        dispatcher = dispatcher_cls(ps.ep_group, ps.ep, ps.ep_rank, n_local, timers=timers, answers=answers, **options)
        moe.wire(dispatcher=dispatcher)
    if not moe_layers:
        experts_per_rank(0, ps.ep)  # refuses ep > 1 for a model without experts
    return model


def parallelize_model(
    model: nn.Module, ps: ParallelState, cfg: ParallelConfig, equal_tokens: bool = False, timers=None, answers=None
) -> nn.Module:
    """Expert parallelism for any model with Optimus MoE layers (a library user's own, too): shard the experts
    over the EP group and install the EP dispatcher (a no-op for EP = 1); hand global load balancing its
    process group. `equal_tokens`, `timers`, `answers`: see apply_expert_parallel."""
    install_balance_group(model, ps)
    return apply_expert_parallel(model, ps, cfg, equal_tokens, timers, answers)


def install_balance_group(model: nn.Module, ps: ParallelState) -> None:
    """Hand every MoE layer the world's group, over which aux_loss_scope=global counts expert choices."""
    if not ps.is_distributed:
        return
    for module in model.modules():
        if isinstance(module, MoE):
            module.wire(world_group=ps.world_group or dist.group.WORLD)
