"""Decoder-only transformer in the OLMoE shape: pre-norm blocks of attention and a dense or MoE FFN."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from optimus.config import ModelConfig
from optimus.model.attention import Attention
from optimus.model.mlp import SwiGLU
from optimus.model.moe.layer import MoE, MoEStats


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    return math.ceil(vocab_size / multiple) * multiple


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: str):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.is_moe = cfg.moe.n_experts > 0 and layer_idx >= cfg.first_k_dense
        self.ffn = MoE(cfg.dim, cfg.moe, kernels) if self.is_moe else SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, h_BSD: torch.Tensor) -> tuple[torch.Tensor, MoEStats | None]:
        h_BSD = h_BSD + self.attn(self.attn_norm(h_BSD))
        if self.is_moe:
            ffn_out, stats = self.ffn(self.ffn_norm(h_BSD))
        else:
            ffn_out, stats = self.ffn(self.ffn_norm(h_BSD)), None
        return h_BSD + ffn_out, stats


@dataclass
class ModelOutput:
    logits_BSV: torch.Tensor
    aux_loss: torch.Tensor  # mean over MoE layers of the load-balancing loss (0 for dense models)
    z_loss: torch.Tensor  # mean over MoE layers of the router z-loss
    tokens_per_expert_LE: torch.Tensor | None  # [MoE layers, E] assignment counts


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = padded_vocab_size(cfg.vocab_size)
        self.embed = nn.Embedding(self.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i, kernels) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, self.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def moe_layers(self) -> list[MoE]:
        return [block.ffn for block in self.layers if block.is_moe]

    def forward(self, tokens_BS: torch.Tensor) -> ModelOutput:
        h_BSD = self.embed(tokens_BS)
        layer_stats = []
        for block in self.layers:
            h_BSD, stats = block(h_BSD)
            if stats is not None:
                layer_stats.append(stats)
        logits_BSV = self.lm_head(self.norm(h_BSD))
        if not layer_stats:
            zero = logits_BSV.new_zeros((), dtype=torch.float32)
            return ModelOutput(logits_BSV, zero, zero, None)
        return ModelOutput(
            logits_BSV,
            aux_loss=torch.stack([s.aux_loss for s in layer_stats]).mean(),
            z_loss=torch.stack([s.z_loss for s in layer_stats]).mean(),
            tokens_per_expert_LE=torch.stack([s.tokens_per_expert_E for s in layer_stats]).detach(),
        )

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) everywhere; residual projections scaled by 1/sqrt(2 * n_layers)."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if param.dim() == 1:  # norm weights
                param.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                param.normal_(0.0, residual_std, generator=generator)
            else:
                param.normal_(0.0, std, generator=generator)
        for moe in self.moe_layers:
            moe.router.expert_bias.zero_()
