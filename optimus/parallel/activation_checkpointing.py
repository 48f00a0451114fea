"""Activation checkpointing, applied to a built model from outside (train.activation_checkpointing).

A checkpointed module keeps only its inputs for the backward and runs its forward
again (torch.utils.checkpoint, non-reentrant) when the backward reaches it. The
modes, from least to most recomputation:

- `selective`: each block's attention module (q/k/v projections, QK-norm, RoPE,
  SDPA, output projection). Per token and layer it drops 5 D + 4 D_kv stored values
  (q and k before and after QK-norm, q/k/v and the output of SDPA, the out-projection
  input; 3 D + 2 D_kv without QK-norm) and keeps the attention's input; the price is one more forward of attention.
- `full`: every block's math. A dense block is recomputed as a whole. In an MoE
  block the EP exchange must not run again in the backward (it would add all-to-alls
  in an order the other ranks do not expect), so the block is cut around it:
  attention, the routed experts' grouped MLP and the shared experts are recomputed;
  the norms, the router, and the dispatch/combine exchange keep their activations
  (the norm inputs and outputs, the router's [T, E] scores and the exchanged
  [T * K, D] token rows and expert outputs). The router is never re-run either, so
  its statistics and losses are recorded once per forward.

optimus.plan.activation_bytes counts what each mode keeps and its peak (the profiler
agrees within 5%: tests/train/test_activation_checkpointing.py). Measured on the tiny recipe
(fp32, 8 x 512 tokens, one CPU process), the live activation peak of a forward and
backward is 799 MiB with none, 686 MiB with selective and 558 MiB with full.

Recomputation repeats the same operations on the same inputs, so losses and
gradients are unchanged (the fp32 trajectory equals `none`); only memory and time
differ. The module names stay as they are (no wrapper module), so checkpoints and
parameter names do not depend on the mode.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from optimus.config import ACTIVATION_CHECKPOINTING, ConfigError, ModelConfig
from optimus.model import Transformer


def checkpoint_module(module: nn.Module) -> None:
    """Make `module` recompute its forward in the backward instead of storing its activations."""
    module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)


def recomputed_modules(block: nn.Module, mode: str) -> list[nn.Module]:
    """The parts of one block whose forward the backward runs again under `mode` (see the module docstring)."""
    if mode == "none":
        return []
    if mode == "full" and not block.is_moe:
        return [block]
    if mode == "selective":
        return [block.attn]
    return [m for m in (block.attn, block.ffn.experts, block.ffn.shared) if m is not None]


def apply_activation_checkpointing(model: Transformer, mode: str) -> Transformer:
    """Checkpoint the parts of every block that `mode` names (recomputed_modules); in place."""
    check_mode(mode)
    for block in model.layers.values():
        for module in recomputed_modules(block, mode):
            checkpoint_module(module)
    return model


def check_mode(mode: str) -> None:
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(
            f"train.activation_checkpointing={mode!r} is not supported: "
            f"set it to one of {', '.join(ACTIVATION_CHECKPOINTING)}."
        )


def recompute_flops_per_token(cfg: ModelConfig, mode: str, seq_len: int) -> float:
    """The FLOPs per token of the forwards the backward runs again under `mode`: 2 x the active matmul
    parameters of recomputed_modules (a routed expert's share is top_k / n_experts of them) plus, where attention
    is recomputed, its scores, 4 D S per layer (a third of flops_per_token's 12 L D S).

    Added to flops_per_token it gives a step's hardware FLOPs (HFU) as Megatron-DeepSpeed counts them: each
    recomputed module's whole forward. torch's non-reentrant checkpoint stops once the backward has what it needs
    (its early stop), so a module's last product may not run again and the hardware does a little less."""
    check_mode(mode)
    with torch.device("meta"):
        model = Transformer(cfg, kernels="torch")
    flops = 0.0
    for block in model.layers.values():
        for module in recomputed_modules(block, mode):
            share = cfg.moe.top_k / cfg.moe.n_experts if module is getattr(block.ffn, "experts", None) else 1.0
            flops += 2.0 * share * sum(p.numel() for p in module.parameters())
            if module is block or module is block.attn:
                flops += 4.0 * cfg.dim * seq_len
    return flops
