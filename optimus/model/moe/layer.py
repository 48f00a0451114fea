"""The MoE feed-forward layer: router -> dispatcher -> grouped experts -> combine (+ shared experts)."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from optimus.config import MoEConfig
from optimus.kernels import KernelBackend
from optimus.model.mlp import SwiGLU
from optimus.model.moe.dispatch import Dispatcher, LocalDispatcher
from optimus.model.moe.experts import GroupedExperts
from optimus.model.moe.router import Router
from optimus.model.moe.stats import PooledBalance, RouterStats, attach_router_loss, router_loss_coefs


class MoE(nn.Module):
    """Tensor in, tensor out: the router losses ride on the backward (`attach_router_loss`) and the routing
    statistics go to `stats`, a `RouterStats` the trainer hands over (None: not recorded).

    `layer_idx` is the block's global index (the key of its statistics) and `n_moe_layers` the number of MoE
    layers in the whole model, over which the router losses are averaged. With aux_loss_layers=pooled the
    model hands every MoE layer the same `pooled_balance` for each forward pass, and the aux loss is the
    layer's term of the pooled loss (see PooledBalance); None: the layer's own aux loss.

    What comes from outside the layer is set through its methods and nowhere else: parallelism's `wire`
    (the dispatcher, the ranks that share a micro-batch, the data-parallel world), and the model's
    `record_stats_to` and `pool_balance_with`.
    """

    def __init__(
        self, dim: int, cfg: MoEConfig, kernels: str | KernelBackend = "auto", layer_idx: int = 0, n_moe_layers: int = 1
    ):
        super().__init__()
        self.router = Router(dim, cfg)
        self.experts = GroupedExperts(cfg.n_experts, dim, cfg.expert_dim, kernels)
        self.shared = SwiGLU(dim, cfg.expert_dim * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.dispatcher: Dispatcher = LocalDispatcher()  # an expert-parallel one from `wire`
        self.layer_idx = layer_idx
        self.n_moe_layers = n_moe_layers
        self.router_loss_coefs = router_loss_coefs(cfg)
        self.stats: RouterStats | None = None
        # The share of each micro-batch's tokens this rank routes: 1 / tp under tensor parallelism, which
        # routes a different slice of the sequence on each tp rank (`wire`). The router losses are means over
        # the routed tokens, so each slice's count for that share of the whole.
        self.router_loss_share = 1.0
        self.pooled_balance: PooledBalance | None = None

    def wire(
        self,
        *,
        dispatcher: Dispatcher | None = None,
        micro_batch_group: dist.ProcessGroup | None = None,
        world_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Install what parallelism gives the layer (optimus.parallel); an argument left None changes nothing.

        - `dispatcher`: expert parallelism's exchange of tokens with the ranks that hold the other experts.
        - `micro_batch_group`: the ranks that route parts of one micro-batch (tensor parallelism): each
          rank's router losses count for 1 / its size, and aux_loss_scope=micro_batch sums the expert
          counts over it.
        - `world_group`: every data-parallel rank, over which aux_loss_scope=global sums the expert counts.
        """
        if dispatcher is not None:
            self.dispatcher = dispatcher
        if micro_batch_group is not None:
            self.router_loss_share = 1.0 / dist.get_world_size(micro_batch_group)
            if self.router.aux_loss_scope == "micro_batch":
                self.router.balance_group = micro_batch_group
        if world_group is not None and self.router.aux_loss_scope == "global":
            self.router.balance_group = world_group

    def record_stats_to(self, stats: RouterStats | None) -> None:
        """Send the routing statistics and take the router-loss gradient scale from `stats` (None: neither)."""
        self.stats = stats

    def pool_balance_with(self, pool: PooledBalance) -> None:
        """aux_loss_layers=pooled: this forward pass's balance pool, shared by every MoE layer of the model."""
        self.pooled_balance = pool

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD, seq_len=x_BSD.shape[1])
        # The dispatcher adds the shared experts' output: an expert-parallel one computes it while tokens travel.
        y_TD = self.dispatcher(x_TD, routing, self.experts, shared=self.shared)
        pool, aux_loss = self.pooled_balance, routing.aux_loss
        if pool is not None:
            pool.add(routing.balance_counts_E1)
            aux_loss = partial(pool.layer_loss, routing.mean_prob_E.detach())  # known once every layer has routed
        if self.stats is not None and self.training:
            self.stats.record(
                self.layer_idx, aux_loss, routing.z_loss, routing.seq_aux_loss, routing.tokens_per_expert_E
            )
        grad_scale = (self.stats.grad_scale if self.stats is not None else 1.0) * self.router_loss_share
        losses = (routing.aux_loss if pool is None else routing.mean_prob_E, routing.z_loss, routing.seq_aux_loss)
        y_TD = attach_router_loss(y_TD, losses, self.router_loss_coefs, grad_scale, self.n_moe_layers, pool)
        return y_TD.view_as(x_BSD)

    def update_bias(self, tokens_per_expert_E: torch.Tensor, rate: float) -> None:
        """After an optimizer step: move the sigmoid router's selection bias toward balance, given the
        step's tokens per expert summed over every data-parallel rank."""
        self.router.update_bias(tokens_per_expert_E, rate)
