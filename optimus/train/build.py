"""Build one rank's model: on the meta device first, then only what the rank owns, directly on its device.

No rank ever holds the whole model: the transformer is constructed on the meta
device (shapes only), its MoE layers keep only this EP rank's block of experts
(still on meta), parameters take their storage dtype, and only then is memory
allocated on `device` and filled by optimus.model.init. Initial values depend
on (seed, parameter name, global expert index) alone, so every layout starts
from the model a single process would build.

Each optimizer group's parameters (dense, routed experts) are allocated as views of
one buffer laid out as the optimizer's flat buffer (optimus.optim.flat_buffer.allocate_flat),
which the optimizer then adopts: the parameters are never copied, so the peak holds
them once (measured in benchmarks/memory_growth.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from optimus.config import ModelConfig
from optimus.model import Transformer
from optimus.model.init import init_parameters
from optimus.model.moe.experts import expert_range
from optimus.optim.flat_buffer import allocate_flat
from optimus.optim.sharded import param_groups
from optimus.parallel.tensor_parallel import apply_tensor_parallel, like_parameter, local_tensor
from optimus.train.precision import cast_parameters


def build_model(
    cfg: ModelConfig,
    kernels: str,
    *,
    ep: int = 1,
    ep_rank: int = 0,
    device: torch.device | str = "cpu",
    param_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    pad_world: int = 1,
    tp_mesh=None,
    sp: bool = True,
    **stage,
) -> Transformer:
    """The model EP rank `ep_rank` of `ep` holds: every dense parameter and experts [ep_rank * E/ep, ...).

    `pad_world`: the ranks that share this model's optimizer (the stage's world size); the parameters'
    flat buffers are padded for it, so the optimizer adopts them whatever its sharding scheme.
    `tp_mesh` (a 1-D DeviceMesh, tp > 1): split the dense layers over it (optimus.parallel.tensor_parallel),
    with sequence parallelism when `sp`; the rank then allocates only its slices.
    """
    with torch.device("meta"):
        model = Transformer(cfg, kernels=kernels, **stage)  # stage: layer_ids / embed / head of a pipeline stage
    for moe in model.moe_layers:
        moe.experts.keep_experts(*expert_range(moe.router.n_experts, ep, ep_rank))
    cast_parameters(model, param_dtype)  # on meta: changes the dtype that is allocated, copies nothing
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh, sp)  # on meta: DTensor parameters with meta slices
    materialise(model, device, pad_world)
    model.tie_weights()
    init_parameters(model, cfg, seed)  # draws in fp32 on the CPU, copies into each parameter's dtype and device
    return model


def materialise(model: nn.Module, device: torch.device | str, pad_world: int) -> None:
    """Give the meta model uninitialised storage on `device`: each optimizer group's parameters in one flat
    buffer, other parameters and buffers one tensor each (what nn.Module.to_empty would do, but grouped)."""
    on_device: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its parameter on the device
    for named in param_groups(model).values():
        if named:
            views = allocate_flat([local_tensor(p) for _, p in named], pad_world, device)
            on_device.update({id(p): like_parameter(p, v) for (_, p), v in zip(named, views)})
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in on_device:  # frozen parameters (not in any optimizer group)
                    on_device[id(p)] = like_parameter(p, torch.empty_like(local_tensor(p), device=device))
                module._parameters[name] = on_device[id(p)]  # a parameter shared by two modules stays shared
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty_like(b, device=device)
