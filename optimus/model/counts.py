"""Parameter counts and training FLOPs per token, computed on the meta device (no memory)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from optimus.config import ModelConfig
from optimus.model.moe.experts import expert_offsets


@dataclass
class ParamCounts:
    total: int
    active: int  # parameters touched by one token: dense + top_k / n_experts of the experts
    dense: int  # everything that is not a routed expert (shared experts included)
    expert: int  # routed experts, all of them
    embedding: int  # input embedding (not a matmul; left out of the FLOPs)

    def as_dict(self) -> dict:
        return asdict(self)


def count_params(model: torch.nn.Module, cfg: ModelConfig) -> ParamCounts:
    """Counts of the full model (all experts), whatever slice of experts this rank holds."""
    dense = expert = 0
    experts = expert_offsets(model)
    for name, param in model.named_parameters():  # tied weights are listed once
        if name in experts:
            expert += param.numel()
        else:
            dense += param.numel()
    # Under expert parallelism a rank holds n_experts / ep of the experts; scale to the full set.
    local_experts = sum(m.experts.n_experts for m in model.moe_layers) if hasattr(model, "moe_layers") else 0
    n_moe_layers = len(model.moe_layers) if hasattr(model, "moe_layers") else 0
    if local_experts:
        expert = expert * (n_moe_layers * cfg.moe.n_experts) // local_experts
    active_expert = expert * cfg.moe.top_k // cfg.moe.n_experts if cfg.moe.n_experts else 0
    embedding = model.embed.weight.numel()
    return ParamCounts(dense + expert, dense + active_expert, dense, expert, embedding)


def count_params_of_config(cfg: ModelConfig) -> ParamCounts:
    """Build the model on the meta device and count; works for the 220B recipe on a laptop."""
    from optimus.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg, kernels="torch")
    return count_params(model, cfg)


def flops_per_token(counts: ParamCounts, cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active matmul params + attention scores (12 L D S, PaLM's convention).

    The input embedding is a lookup, not a matmul, so it is left out unless tied to the LM head.
    """
    matmul_params = counts.active - (0 if cfg.tie_embeddings else counts.embedding)
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.dim * seq_len
