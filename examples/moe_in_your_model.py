"""The Optimus MoE layer inside your own nn.Module, trained with a plain PyTorch optimizer.

    python examples/moe_in_your_model.py

A small next-token model (embedding -> MoE feed-forward -> head) learns sequences that count
up by a random stride of 1, 2 or 3. Seeing one token at a time, it cannot know the stride, so
its loss falls from ln(32) (guessing) towards ln(3) (the best it can do).

The MoE layer takes and returns [batch, seq, dim] tensors; its router losses (load balancing,
z-loss) ride on its output's backward, so the training loop needs no extra term.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from optimus.config import MoEConfig
from optimus.model.moe import MoE

VOCAB = 32


class TinyMoELM(nn.Module):
    """Embedding, one residual MoE feed-forward block, and an output head."""

    def __init__(self, dim: int = 32, n_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.norm = nn.RMSNorm(dim)
        moe_cfg = MoEConfig(n_experts=n_experts, top_k=top_k, expert_dim=2 * dim, aux_loss_coef=0.01)
        self.moe = MoE(dim, moe_cfg, kernels="torch")
        self.head = nn.Linear(dim, VOCAB)
        # The expert weights are allocated uninitialised: initialise them as you would any weight.
        for name, param in self.named_parameters():
            if param.dim() > 1:
                nn.init.normal_(param, std=0.02 if "experts" not in name else dim**-0.5)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        h_BSD = self.embed(tokens_BS)
        h_BSD = h_BSD + self.moe(self.norm(h_BSD))
        return self.head(h_BSD)  # [B, S, VOCAB]


def batch(generator: torch.Generator, batch_size: int = 16, seq_len: int = 12) -> torch.Tensor:
    """Sequences that count up by a random stride (mod VOCAB): the next token follows from the last two."""
    start_B1 = torch.randint(0, VOCAB, (batch_size, 1), generator=generator)
    stride_B1 = torch.randint(1, 4, (batch_size, 1), generator=generator)
    return (start_B1 + stride_B1 * torch.arange(seq_len)) % VOCAB  # [B, S]


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyMoELM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(1, args.steps + 1):
        tokens_BS = batch(generator)
        logits_BSV = model(tokens_BS[:, :-1])
        loss = F.cross_entropy(logits_BSV.flatten(0, 1), tokens_BS[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % 20 == 0 or step == 1:
            print(f"step {step:>4} | loss {loss.item():.4f}")
    return losses


if __name__ == "__main__":
    main()
