"""Initial parameter values as a function of (seed, parameter name, global expert index) alone.

Every parameter (and every expert's slice of a stacked expert weight) draws from its
own CPU generator, seeded from a stable hash of those three, in fp32; the draw is then
copied into the parameter in its own dtype and on its own device. So a rank that holds
only some experts, a model built on the meta device and materialised later, or a model
on a GPU all start from exactly the values one CPU process would have.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from optimus.config import ModelConfig
from optimus.model.moe.experts import expert_offsets
from optimus.model.moe.router import Router

RESIDUAL_PROJECTIONS = ("wo.weight", "w2.weight", "experts.w2")
EMBEDDING = "embed.weight"
# With tie_embeddings the LM head is the embedding; a pipeline stage that holds the head alone keeps a copy of it,
# drawn under the embedding's name so that it starts equal.
TIED = {"lm_head.weight": "embed.weight"}


def init_seed(seed: int, name: str, expert: int | None = None) -> int:
    """A 63-bit generator seed from (seed, name, expert); sha256 is the same in every process (hash() is not)."""
    key = f"{seed}/{name}" if expert is None else f"{seed}/{name}/{expert}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def _normal(shape: torch.Size, std: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


def _copy_draw(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a draw of the whole parameter into `param`, or into this rank's slice of it when tensor
    parallelism made it a DTensor (on a 1-D mesh; the sizes divide evenly, see validate_tensor_parallel)."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        for placement in param.placements:
            if placement.is_shard():
                full = full.chunk(mesh.size(), dim=placement.dim)[mesh.get_local_rank()]
        param = param.to_local()
    param.copy_(full)


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Normal(0, init_std) matrices, residual projections scaled by 1/sqrt(2 * n_layers), the token embedding
    Normal(0, embed_init_std or init_std), norms 1, router bias 0."""
    std = cfg.init_std
    residual_std = std / math.sqrt(2 * cfg.n_layers)
    # A tied embedding is the LM head too: it keeps the head's scale.
    embed_std = std if cfg.embed_init_std is None or cfg.tie_embeddings else cfg.embed_init_std
    offsets = expert_offsets(model)
    for name, param in model.named_parameters():
        if param.dim() == 1:  # norm weights
            _copy_draw(param, torch.ones(param.shape))
            continue
        param_std = residual_std if name.endswith(RESIDUAL_PROJECTIONS) else std
        if name.endswith(EMBEDDING):
            param_std = embed_std
        offset = offsets.get(name)
        if offset is None:
            drawn_as = TIED.get(name, name) if cfg.tie_embeddings else name
            _copy_draw(param, _normal(param.shape, param_std, init_seed(seed, drawn_as)))
            continue
        for local, expert_param in enumerate(param):  # [E_local, ...]: one draw per global expert
            expert_param.copy_(_normal(expert_param.shape, param_std, init_seed(seed, name, offset + local)))
    for module in model.modules():
        if isinstance(module, Router):
            module.expert_bias.zero_()
