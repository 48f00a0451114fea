"""Build one rank's model: on the meta device first, then only what the rank owns, directly on its device.

No rank ever holds the whole model: the transformer is constructed on the meta
device (shapes only), its MoE layers keep only this EP rank's block of experts
(still on meta), parameters take their storage dtype, and only then is memory
allocated on `device` and filled by optimus.model.init. Initial values depend
on (seed, parameter name, global expert index) alone, so every layout starts
from the model a single process would build.
"""

from __future__ import annotations

import torch

from optimus.config import ModelConfig
from optimus.model import Transformer
from optimus.model.init import init_parameters
from optimus.model.moe.experts import expert_range
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
    **stage,
) -> Transformer:
    """The model EP rank `ep_rank` of `ep` holds: every dense parameter and experts [ep_rank * E/ep, ...)."""
    with torch.device("meta"):
        model = Transformer(cfg, kernels=kernels, **stage)  # stage: layer_ids / embed / head of a pipeline stage
    for moe in model.moe_layers:
        moe.experts.keep_experts(*expert_range(moe.router.n_experts, ep, ep_rank))
    cast_parameters(model, param_dtype)  # on meta: changes the dtype that to_empty allocates, copies nothing
    model.to_empty(device=device)
    model.tie_weights()
    init_parameters(model, cfg, seed)  # draws in fp32 on the CPU, copies into each parameter's dtype and device
    return model
