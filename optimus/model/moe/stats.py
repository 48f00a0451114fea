"""Router losses and routing statistics, kept off the hidden-state path.

A pipeline stage hands one tensor from block to block, so an MoE layer cannot return its
router losses next to its output. Two pieces replace that:

- `attach_router_loss` puts the weighted router losses on the autograd graph. It is the
  identity on the hidden states in forward; in backward it also gives each layer's aux,
  z and sequence-wise losses the gradient they would get had they been added to the LM
  loss (coefficient / number of MoE layers, times the scale the trainer divides the LM
  loss by before backward). So `lm_loss.backward()` trains the routers as well.
- `RouterStats`, a collector that the trainer owns and hands to the model, keeps for every
  forward pass of every MoE layer the detached loss values and the tokens per expert: the
  logged losses, the load-imbalance metric and the sigmoid router's bias update read it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from optimus.config import MoEConfig, moe_aux_loss_coef


def router_loss_coefs(moe: MoEConfig) -> tuple[float, float, float]:
    """The coefficients in force for the (aux, z, sequence-wise) router losses."""
    return moe_aux_loss_coef(moe), moe.z_loss_coef, moe.seq_aux_loss_coef


def router_loss(moe: MoEConfig, aux_loss: torch.Tensor, z_loss: torch.Tensor, seq_aux_loss: torch.Tensor):
    """The router losses weighted by their coefficients: what a micro-batch's loss adds to its LM loss."""
    aux_coef, z_coef, seq_coef = router_loss_coefs(moe)
    loss = aux_coef * aux_loss + z_coef * z_loss
    if seq_coef:
        loss = loss + seq_coef * seq_aux_loss
    return loss


class _RouterLossGrad(torch.autograd.Function):
    """Identity on `hidden`; its backward also back-propagates `coef_k * grad_scale / n_layers` into loss k."""

    @staticmethod
    def forward(ctx, hidden, aux_loss, z_loss, seq_aux_loss, coefs, grad_scale, n_layers):
        ctx.coefs, ctx.grad_scale, ctx.n_layers = coefs, grad_scale, n_layers
        ctx.loss_dtype, ctx.loss_device = aux_loss.dtype, aux_loss.device
        return hidden

    @staticmethod
    def backward(ctx, grad_hidden):
        # The same operations, in the same order, as the backward of (lm + coef * mean_l(loss_l)) * grad_scale.
        scale = torch.full((), ctx.grad_scale, dtype=ctx.loss_dtype, device=ctx.loss_device)
        grads = [(scale * coef) / ctx.n_layers if coef and needs else None
                 for coef, needs in zip(ctx.coefs, ctx.needs_input_grad[1:4])]  # fmt: skip
        return grad_hidden, *grads, None, None, None


def attach_router_loss(
    hidden: torch.Tensor, losses: Sequence[torch.Tensor], coefs: Sequence[float], grad_scale: float, n_layers: int
) -> torch.Tensor:
    """`hidden` unchanged, with the (aux, z, seq) router `losses` of one of `n_layers` MoE layers riding on its
    backward: the gradient of coef_k * loss_k / n_layers per unit of `grad_scale`."""
    if not torch.is_grad_enabled() or not any(loss.requires_grad for loss in losses):
        return hidden
    return _RouterLossGrad.apply(hidden, *losses, tuple(coefs), grad_scale, n_layers)


class RouterStats:
    """What the routers saw during one optimizer step, per MoE layer and forward pass.

    The trainer makes one, hands it to the model (`Transformer.attach_router_stats`) and
    resets it before each step. Layers are keyed by their global index, so the collectors
    of pipeline stages, which each see some layers only, add up to the whole model's.
    `grad_scale` is the factor the trainer applies to the LM loss before backward (1 over
    the accumulation steps); the router losses' gradients get the same (see
    `attach_router_loss`).
    """

    def __init__(self, moe_layer_ids: Sequence[int], n_experts: int, device: torch.device | str = "cpu"):
        self.layer_ids = list(moe_layer_ids)  # every MoE layer of the whole model, in order
        self.n_experts = n_experts
        self.device = torch.device(device)
        self.grad_scale = 1.0
        self._row = {layer_idx: row for row, layer_idx in enumerate(self.layer_ids)}
        self.reset()

    def reset(self) -> None:
        self._losses: dict[int, list[torch.Tensor]] = {}  # layer -> one [3] (aux, z, seq) per forward pass
        self._counts: dict[int, torch.Tensor] = {}  # layer -> [E] tokens per expert, summed over passes

    def row(self, layer_idx: int) -> int:
        """The row of MoE layer `layer_idx` in `tokens_per_expert`."""
        return self._row[layer_idx]

    def record(self, layer_idx: int, aux_loss, z_loss, seq_aux_loss, tokens_per_expert_E: torch.Tensor) -> None:
        if layer_idx not in self._row:
            raise KeyError(f"layer {layer_idx} is not an MoE layer of this model (MoE layers: {self.layer_ids})")
        self._losses.setdefault(layer_idx, []).append(torch.stack([aux_loss, z_loss, seq_aux_loss]).detach())
        counts_E = tokens_per_expert_E.detach()
        self._counts[layer_idx] = counts_E + self._counts[layer_idx] if layer_idx in self._counts else counts_E

    def micro_batch_means(self, n_micro_batches: int, group=None) -> torch.Tensor:
        """[M, 3]: per micro-batch (in forward order), the (aux, z, seq) losses averaged over all MoE layers.

        Layers this collector did not see (another pipeline stage's) count as zeros here and are summed
        in over `group`, the ranks that hold the other stages; zero without MoE layers.
        """
        losses_3ML = torch.zeros(3, n_micro_batches, len(self.layer_ids), device=self.device)
        for layer_idx, passes in self._losses.items():
            if len(passes) != n_micro_batches:
                raise RuntimeError(
                    f"MoE layer {layer_idx} ran {len(passes)} forward passes in a step of {n_micro_batches} "
                    "micro-batches: each micro-batch must run each layer's router exactly once."
                )
            losses_3ML[:, :, self._row[layer_idx]] = torch.stack(passes, dim=1).to(self.device)  # [3, M]
        if group is not None:
            dist.all_reduce(losses_3ML, group=group)
        if not self.layer_ids:
            return losses_3ML.sum(dim=2).T
        # A contiguous row per (loss, micro-batch): the same mean as over the layers' stacked values.
        return torch.stack([losses_3ML[k, m].mean() for m in range(n_micro_batches) for k in range(3)]).view(-1, 3)

    def tokens_per_expert(self) -> torch.Tensor | None:
        """[L, E] assignments per expert summed over the step's forward passes, rows in `layer_ids` order
        (zeros for layers this collector did not see); None for a model without MoE layers."""
        if not self.layer_ids:
            return None
        counts_LE = torch.zeros(len(self.layer_ids), self.n_experts, device=self.device)
        for layer_idx, counts_E in self._counts.items():
            counts_LE[self._row[layer_idx]] = counts_E.to(self.device)
        return counts_LE
