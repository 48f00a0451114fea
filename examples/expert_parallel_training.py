"""Your own model trained with expert parallelism and the EP-aware sharded optimizer, without the Optimus trainer.

    torchrun --nproc-per-node 2 examples/expert_parallel_training.py      # 2 ranks, EP = 2 (gloo on CPUs)
    python examples/expert_parallel_training.py                           # 1 process: the same run, unsharded

Every rank builds the whole model from the same seed; `parallelize_model` then keeps the rank's
block of experts and installs the all-to-all dispatcher, and `ShardedAdamW` shards the optimizer
state (dense parameters over all ranks, expert parameters over the ranks holding the same
experts). Each rank trains on its slice of the global batch; the losses printed on rank 0 are
those of the whole global batch, and equal the single-process run's up to rounding.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from optimus.config import MoEConfig, OptimConfig, ParallelConfig
from optimus.model.moe import MoE
from optimus.optim import ShardedAdamW
from optimus.parallel import build_parallel_state, parallelize_model

VOCAB, DIM, N_EXPERTS = 64, 32, 4
GLOBAL_BATCH, SEQ_LEN = 8, 16


class MyModel(nn.Module):
    """Embedding, two residual MoE blocks, head. Expert weights must sit under a module named `experts`
    (as inside `MoE`): that is how the optimizer tells expert parameters from dense ones."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        # aux_loss_scope="global": the load-balancing loss counts the whole global batch, so it does not
        # depend on how the batch is split over ranks.
        moe_cfg = MoEConfig(n_experts=N_EXPERTS, top_k=2, expert_dim=64, aux_loss_scope="global")
        self.norms = nn.ModuleList(nn.RMSNorm(DIM) for _ in range(2))
        self.moes = nn.ModuleList(MoE(DIM, moe_cfg, kernels="torch", layer_idx=i, n_moe_layers=2) for i in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        for param in self.parameters():
            if param.dim() > 1:
                nn.init.normal_(param, std=0.05)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        h_BSD = self.embed(tokens_BS)
        for norm, moe in zip(self.norms, self.moes):
            h_BSD = h_BSD + moe(norm(h_BSD))
        return self.head(h_BSD)  # [B, S, VOCAB]


def global_batch(step: int) -> torch.Tensor:
    """The same [GLOBAL_BATCH, SEQ_LEN + 1] tokens on every rank: sequences that count up by one (mod VOCAB)."""
    generator = torch.Generator().manual_seed(step)
    start_B1 = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=generator)
    return (start_B1 + torch.arange(SEQ_LEN + 1)) % VOCAB


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)

    distributed = "RANK" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if distributed else 1
    ps = build_parallel_state(ep=world)  # every rank in one EP group; EP = 1 for a single process

    torch.manual_seed(0)  # the same initial model on every rank
    model = parallelize_model(MyModel(), ps, ParallelConfig(ep=ps.ep, dispatcher="alltoall"))
    scheme = "ep_aware" if distributed else "none"
    optimizer = ShardedAdamW(model, OptimConfig(weight_decay=0.0), ps, grad_clip=1.0, scheme=scheme)

    losses = []
    rows = GLOBAL_BATCH // world
    for step in range(args.steps):
        tokens_BS = global_batch(step)[ps.rank * rows : (ps.rank + 1) * rows]  # this rank's slice
        logits_BSV = model(tokens_BS[:, :-1])
        loss = F.cross_entropy(logits_BSV.flatten(0, 1), tokens_BS[:, 1:].flatten())
        loss.backward()  # the optimizer averages gradients over the ranks in step()
        grad_norm = optimizer.step(lr=1e-2)
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        if distributed:
            dist.all_reduce(mean_loss)
            mean_loss /= world
        losses.append(mean_loss.item())
        if ps.is_main:
            print(json.dumps({"step": step + 1, "loss": losses[-1], "grad_norm": grad_norm}), flush=True)
    if distributed:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
