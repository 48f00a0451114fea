"""Applying the parallel layout to a model from outside: `parallelize` is the one place that does it.

`optimus.model.build_model` builds the whole model on the meta device (shapes, no memory). `parallelize` then
applies the layout of `cfg` to it for this rank, in this order:

    1. pipeline cutting   parallel.pp > 1: keep this rank's stages (optimus.parallel.pipeline.cut_stage)
    2. storage dtype      every floating-point parameter in train.dtype, still on meta (tensor parallelism
                          carries it into its slices)
    3. tensor parallelism parallel.tp > 1: DTensor plans on each stage, sequence parallelism with parallel.sp
                          (optimus.parallel.tensor_parallel); MoE layers fold the tp ranks into expert parallelism
    4. expert parallelism keep this rank's block of experts, install the EP dispatcher; global load balancing
                          gets its process group (optimus.parallel.expert_parallel); a stage of dense layers
                          only is left as it is
    5. activation         train.activation_checkpointing (optimus.parallel.activation_checkpointing)
       checkpointing
    6. materialise        every parameter on the device; each data-parallel group's trained parameters (dense,
                          routed experts) in one flat buffer laid out for the sharded optimizer, which adopts it
                          (optimus.parallel.flat_buffer.allocate_flat)
    7. initialise         values from (train.seed, parameter name, global expert index) alone
                          (optimus.model.init), so every layout starts from the model one process would build

Steps 1-5 act on the meta device, so no rank ever allocates more than its own part. Each step reads only what
the steps before it produced: TP splits the blocks a stage holds, EP slices the experts TP left whole,
checkpointing wraps the modules as they will run, and materialising sees the final shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from optimus.config import TORCH_DTYPES, OptimusConfig
from optimus.model import Transformer
from optimus.model.init import init_parameters
from optimus.parallel.activation_checkpointing import apply_activation_checkpointing
from optimus.parallel.expert_parallel import parallelize_model
from optimus.parallel.flat_buffer import allocate_flat, param_groups
from optimus.parallel.pipeline import (
    TiedEmbedding,
    cut_stage,
    merge_stages,
    rank_stage_indices,
    stage_layer_ids,
    stage_sizes,
    tied_embedding,
)
from optimus.parallel.state import ParallelState
from optimus.parallel.tensor_parallel import apply_tensor_parallel, like_parameter, local_tensor


@dataclass
class ParallelModel:
    """This rank's part of the model."""

    stages: list[Transformer]  # the modules this rank runs forward, in stage order (the model itself when pp = 1)
    stage_indices: list[int]  # their places among the n_stages stages
    n_stages: int
    module: Transformer  # every parameter this rank holds under its whole-model name (the stages merged)
    tied: TiedEmbedding | None  # tie_embeddings with the embedding and the head on different pipeline ranks


def parallelize(
    model: Transformer, ps: ParallelState, cfg: OptimusConfig, device: torch.device | str, timers=None, answers=None
) -> ParallelModel:
    """Apply `cfg`'s layout to `model`, built whole on the meta device, for this rank of `ps` (see the module
    docstring). `timers` (profile.timers): the EP dispatchers time their exchanges with it; `answers`: a dry
    run's optimus.load_model.LoadAnswers to their value reads."""
    p, t = cfg.parallel, cfg.train
    n_stages = ps.pp * p.pp_virtual
    indices = rank_stage_indices(ps.pp_rank, ps.pp, p.pp_virtual)
    stages = cut_stages(model, n_stages, indices, p.pp_layers)
    stage_ps = ps.stage()  # expert parallelism and the optimizer work within a pipeline stage's ranks
    for stage in stages:
        cast_parameters(stage, TORCH_DTYPES[t.dtype])  # on meta: the dtype that will be allocated
        if ps.tp > 1:
            apply_tensor_parallel(stage, ps.tp_mesh, ps.sp)
        if stage.moe_layers:  # a stage of dense layers only has no experts to split (validate checked the model)
            parallelize_model(stage, stage_ps, p, True, timers, answers)  # equal tokens: one micro-batch shape per rank
        apply_activation_checkpointing(stage, t.activation_checkpointing)
    trained = param_groups(stages[0] if n_stages == 1 else merge_stages(stages))  # a tied head copy is not
    materialise(stages, trained, device, stage_ps.world_size)
    for stage in stages:
        init_parameters(stage, cfg.model, t.seed)  # draws in fp32 on the CPU, copies into each parameter
    module = stages[0] if n_stages == 1 else merge_stages(stages)
    return ParallelModel(stages, indices, n_stages, module, tied_embedding(stages, indices, n_stages, ps))


def cut_stages(model: Transformer, n_stages: int, indices: list[int], pp_layers=None) -> list[Transformer]:
    """The stages `indices` of `model` cut into `n_stages` (the model itself when there is one stage)."""
    if n_stages == 1:
        return [model]
    layer_ids = stage_layer_ids(stage_sizes(model.cfg, n_stages, pp_layers))
    return [cut_stage(model, layer_ids[i], embed=i == 0, head=i == n_stages - 1) for i in indices]


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every floating-point parameter in `dtype`; buffers (RoPE tables, router bias) keep their precision."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


def materialise(
    roots: list[nn.Module], groups: dict[str, list[tuple[str, nn.Parameter]]], device: torch.device | str,
    pad_world: int,
) -> None:  # fmt: skip
    """Give meta modules uninitialised storage on `device`: each of `groups`' parameters in one flat buffer (padded
    for `pad_world` owner ranks), every other parameter and buffer a tensor of its own (what nn.Module.to_empty
    does, but grouped). A tensor that several modules share (a tied weight, a stage's module in the merged one)
    stays shared."""
    on_device: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its tensor on the device
    for named in groups.values():
        if named:
            views = allocate_flat([local_tensor(p) for _, p in named], pad_world, device)
            on_device.update({id(p): like_parameter(p, v) for (_, p), v in zip(named, views)})
    for root in roots:
        for module in root.modules():
            held = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for name, meta in held:
                if id(meta) not in on_device:  # untrained, a tied copy that another rank trains, or a buffer
                    empty = torch.empty_like(local_tensor(meta), device=device)
                    on_device[id(meta)] = like_parameter(meta, empty) if isinstance(meta, nn.Parameter) else empty
                setattr(module, name, on_device[id(meta)])
