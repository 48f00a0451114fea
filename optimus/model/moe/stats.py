"""Router losses and routing statistics, kept off the hidden-state path.

A pipeline stage hands one tensor from block to block, so an MoE layer cannot return its
router losses next to its output. Three pieces replace that:

- `attach_router_loss` puts the weighted router losses on the autograd graph. It is the
  identity on the hidden states in forward; in backward it also gives each layer's aux,
  z and sequence-wise losses the gradient they would get had they been added to the LM
  loss (coefficient / number of MoE layers, times the scale the trainer divides the LM
  loss by before backward). So `lm_loss.backward()` trains the routers as well.
- `PooledBalance` (`model.moe.aux_loss_layers=pooled`) sums one forward pass's expert
  counts over its MoE layers, as transformers' `load_balancing_loss_func` does; the layers
  read the pooled fractions in their backward, once every layer has routed.
- `RouterStats`, a collector that the trainer owns and hands to the model, keeps for every
  forward pass of every MoE layer the detached loss values and the tokens per expert: the
  logged losses, the load-imbalance metric and the sigmoid router's bias update read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from optimus.config import MoEConfig, moe_aux_loss_coef
from optimus.model.moe.router import balance_loss, expert_fractions


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


class PooledBalance:
    """The expert counts of one forward pass summed over the model's MoE layers (aux_loss_layers=pooled).

    transformers' load_balancing_loss_func pools its layers: E * sum_e F_e mean_l(P_le), where F_e = sum_l
    count_le / sum_l tokens_l. That is the mean over layers of E * sum_e F_e P_le, layer l's term, whose
    gradient through P_le is E * F_e per unit (F, made of counts, carries none). F is known only once every
    layer has routed: the layers read it in their backward, and the logged values at the end of the step.
    """

    def __init__(self):
        self._counts_E1: torch.Tensor | None = None

    def add(self, counts_E1: torch.Tensor) -> None:
        """A layer's [choices per expert..., tokens] (router.Routing.balance_counts_E1)."""
        counts_E1 = counts_E1.detach()
        self._counts_E1 = counts_E1 if self._counts_E1 is None else self._counts_E1 + counts_E1

    def fraction_E(self) -> torch.Tensor:
        """F_e: every layer's choices of expert e over every layer's tokens."""
        return expert_fractions(self._counts_E1)

    def layer_loss(self, mean_prob_E: torch.Tensor) -> torch.Tensor:
        """A layer's term E * sum_e F_e P_e, given its P (`mean_prob_E`)."""
        return balance_loss(self.fraction_E(), mean_prob_E)


class _RouterLossGrad(torch.autograd.Function):
    """Identity on `hidden`; its backward also back-propagates `coef_k * grad_scale / n_layers` into loss k
    (with a `pool`, the aux input is the layer's P_E and its gradient that times E * F_E, see PooledBalance)."""

    @staticmethod
    def forward(ctx, hidden, aux_loss, z_loss, seq_aux_loss, coefs, grad_scale, n_layers, pool):
        ctx.coefs, ctx.grad_scale, ctx.n_layers, ctx.pool = coefs, grad_scale, n_layers, pool
        ctx.loss_dtype, ctx.loss_device = aux_loss.dtype, aux_loss.device
        return hidden

    @staticmethod
    def backward(ctx, grad_hidden):
        # The same operations, in the same order, as the backward of (lm + coef * mean_l(loss_l)) * grad_scale.
        scale = torch.full((), ctx.grad_scale, dtype=ctx.loss_dtype, device=ctx.loss_device)
        grads = [(scale * coef) / ctx.n_layers if coef and needs else None
                 for coef, needs in zip(ctx.coefs, ctx.needs_input_grad[1:4])]  # fmt: skip
        if ctx.pool is not None and grads[0] is not None:
            fraction_E = ctx.pool.fraction_E()
            grads[0] = grads[0] * (fraction_E.numel() * fraction_E)  # d(E * sum_e F_e P_e) / dP = E * F
        return grad_hidden, *grads, None, None, None, None


def attach_router_loss(
    hidden: torch.Tensor,
    losses: Sequence[torch.Tensor],
    coefs: Sequence[float],
    grad_scale: float,
    n_layers: int,
    pool: PooledBalance | None = None,
) -> torch.Tensor:
    """`hidden` unchanged, with the (aux, z, seq) router `losses` of one of `n_layers` MoE layers riding on its
    backward: the gradient of coef_k * loss_k / n_layers per unit of `grad_scale`. With `pool`, the aux entry
    is the layer's P_E and its loss the layer's term of the pooled loss (PooledBalance.layer_loss)."""
    if not torch.is_grad_enabled() or not any(loss.requires_grad for loss in losses):
        return hidden
    return _RouterLossGrad.apply(hidden, *losses, tuple(coefs), grad_scale, n_layers, pool)


class RouterStats:
    """What the routers saw during one optimizer step, per MoE layer and forward pass.

    The trainer makes one, hands it to the model (`Transformer.attach_router_stats`) and
    resets it before each step. Layers are keyed by their global index, so the collectors
    of pipeline stages, which each see some layers only, add up to the whole model's.
    `grad_scale` is the factor the trainer applies to the LM loss before backward (1 over
    the accumulation steps); the router losses' gradients get the same (see
    `attach_router_loss`).
    """

    def __init__(
        self, moe_layer_ids: Sequence[int], n_experts: int, device: torch.device | str = "cpu", grad_scale: float = 1.0
    ):
        self.layer_ids = list(moe_layer_ids)  # every MoE layer of the whole model, in order
        self.n_experts = n_experts
        self.device = torch.device(device)
        self.grad_scale = grad_scale
        self._row = {layer_idx: row for row, layer_idx in enumerate(self.layer_ids)}
        self.reset()

    def reset(self) -> None:
        # layer -> per forward pass, its aux loss (a value, or a function giving it) and its [2] (z, seq) losses
        self._losses: dict[int, list[tuple[torch.Tensor | Callable[[], torch.Tensor], torch.Tensor]]] = {}
        self._counts: dict[int, torch.Tensor] = {}  # layer -> [E] tokens per expert, summed over passes

    def row(self, layer_idx: int) -> int:
        """The row of MoE layer `layer_idx` in `tokens_per_expert`."""
        return self._row[layer_idx]

    def record(self, layer_idx: int, aux_loss, z_loss, seq_aux_loss, tokens_per_expert_E: torch.Tensor) -> None:
        """One forward pass of MoE layer `layer_idx`. `aux_loss` is a value, or a function giving it at the end
        of the step (aux_loss_layers=pooled: the layer's term needs the counts of the layers after it)."""
        if layer_idx not in self._row:
            raise KeyError(f"layer {layer_idx} is not an MoE layer of this model (MoE layers: {self.layer_ids})")
        # Values only: a loss kept with its graph would keep the graph's leaves too (a pipeline stage's received
        # input, one per micro-batch) until the end of the step.
        aux = aux_loss if callable(aux_loss) else aux_loss.detach()
        self._losses.setdefault(layer_idx, []).append((aux, torch.stack([z_loss, seq_aux_loss]).detach()))
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
            losses_M3 = [
                torch.cat([(aux() if callable(aux) else aux).detach().view(1), z_seq]) for aux, z_seq in passes
            ]
            losses_3ML[:, :, self._row[layer_idx]] = torch.stack(losses_M3, dim=1).to(self.device)  # [3, M]
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
