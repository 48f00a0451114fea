"""Decoder-only transformer in the OLMoE shape: pre-norm blocks of attention and a dense or MoE FFN."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from optimus.config import ConfigError, ModelConfig, padded_vocab_size
from optimus.kernels import KernelBackend, KernelUnavailable, get_backend
from optimus.model.attention import Attention
from optimus.model.init import init_parameters
from optimus.model.loss import head_cross_entropy, head_logits
from optimus.model.mlp import SwiGLU
from optimus.model.moe.layer import MoE
from optimus.model.moe.stats import PooledBalance, RouterStats
from optimus.model.norm import RMSNorm


def build_model(cfg: ModelConfig, kernels: str | KernelBackend = "auto") -> Transformer:
    """The whole model on the meta device: shapes and dtypes, no memory. `optimus.parallel.parallelize` lays it out
    for a rank and materialises that rank's part; `Transformer(cfg)` builds it whole on the current device."""
    with torch.device("meta"):
        return Transformer(cfg, kernels=kernels)


def moe_layer_ids(cfg: ModelConfig) -> list[int]:
    """Global indices of the blocks whose FFN is an MoE layer (all but the first `first_k_dense`)."""
    return list(range(cfg.first_k_dense, cfg.n_layers)) if cfg.moe.n_experts > 0 else []


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: KernelBackend):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm)
        self.attn = Attention(cfg, kernels.rms_norm, kernels.rope)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm)
        moe_ids = moe_layer_ids(cfg)
        self.is_moe = layer_idx in moe_ids
        if self.is_moe:
            self.ffn = MoE(cfg.dim, cfg.moe, kernels, layer_idx=layer_idx, n_moe_layers=len(moe_ids))
        else:
            self.ffn = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        h_BSD = h_BSD + self.attn(self.attn_norm(h_BSD))
        return h_BSD + self.ffn(self.ffn_norm(h_BSD))


class Transformer(nn.Module):
    """The model, or one pipeline stage of it: the blocks `layer_ids` (default all), with the embedding
    (`embed`) and the final norm and LM head (`head`) when the stage holds them.

    Blocks live in `layers`, a ModuleDict keyed by their global index ("0", "1", ...), so a parameter
    has the same name (`layers.3.attn.wq.weight`) in every stage layout. The forward takes tokens [B, S]
    when the stage holds the embedding, else hidden states [B, S, D], and returns logits [B, S, V] when
    it holds the head, else hidden states: one tensor in, one out. V is the padded vocabulary; the logits
    of its padding rows are -inf, so that the model is a softmax over its own `cfg.vocab_size` tokens.
    Router losses travel on the backward and routing statistics go to a `RouterStats` (see
    `attach_router_stats`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        kernels: str | KernelBackend = "auto",
        layer_ids: Sequence[int] | None = None,
        embed: bool = True,
        head: bool = True,
    ):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = padded_vocab_size(cfg.vocab_size)
        layer_ids = range(cfg.n_layers) if layer_ids is None else layer_ids
        self.embed = nn.Embedding(self.vocab_size, cfg.dim) if embed else None
        try:  # the `kernels` key of a config: the user's to change, like any other
            kernels = kernels if isinstance(kernels, KernelBackend) else get_backend(kernels)
        except KernelUnavailable as err:
            raise ConfigError(str(err)) from None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, kernels) for i in layer_ids})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm) if head else None
        self.lm_head = nn.Linear(cfg.dim, self.vocab_size, bias=False) if head else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (tie_embeddings); again after to_empty, which unties them.
        A pipeline stage with only one of the two keeps its own tensor; the pipeline keeps the head's copy
        equal to the embedding and adds its gradient into the embedding's (optimus.parallel.pipeline)."""
        if self.cfg.tie_embeddings and self.embed is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed.weight

    @property
    def moe_layers(self) -> list[MoE]:
        """This model's (or stage's) MoE layers, in layer order."""
        return [module for module in self.modules() if isinstance(module, MoE)]

    def attach_router_stats(self, stats: RouterStats | None) -> None:
        """Hand every MoE layer the collector of its routing statistics and router-loss gradient scale."""
        for moe in self.moe_layers:
            moe.record_stats_to(stats)

    def forward(self, x: torch.Tensor, targets_BS: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] (or hidden states [B, S, D] without the embedding) -> logits [B, S, V] (or hidden).

        With `targets_BS` (and the head): the per-token cross-entropy [B, S] in fp32 instead of the
        logits, fused with the LM head so that the [B, S, V] logits are never materialised.
        """
        if self.cfg.moe.aux_loss_layers == "pooled":
            self._share_balance_pool()
        h_BSD = self.embed(x) if self.embed is not None else x
        for block in self.layers.values():
            h_BSD = block(h_BSD)
        if self.lm_head is None:
            return h_BSD
        h_BSD = self.norm(h_BSD)
        if targets_BS is not None:
            return head_cross_entropy(self.lm_head, h_BSD, targets_BS, self.cfg.vocab_size)
        return head_logits(self.lm_head, h_BSD, self.cfg.vocab_size)  # under tensor parallelism [B, S, V / tp]

    def _share_balance_pool(self) -> None:
        """aux_loss_layers=pooled: one PooledBalance for this forward pass, shared by every MoE layer. A model
        that holds only some MoE layers (a pipeline stage) would pool those only: validate_pipeline refuses it."""
        pool = PooledBalance()
        for moe in self.moe_layers:
            moe.pool_balance_with(pool)

    def init_weights(self, seed: int | torch.Generator = 0) -> None:
        """Initialise every parameter from `seed` (a Generator stands for its initial seed): see optimus.model.init."""
        if isinstance(seed, torch.Generator):
            seed = seed.initial_seed()
        init_parameters(self, self.cfg, seed)
