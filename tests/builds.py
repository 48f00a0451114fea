"""Models as `optimus train` builds them on one rank: `parallelize` applied to the whole model on the meta device.

from tests.builds import fake_process_group, rank_model

model = rank_model(cfg, seed=3)                       # one process
with fake_process_group(world=4, rank=1):             # rank 1 of 4, without the other three processes
    model = rank_model(cfg, build_parallel_state(ep=2), seed=3)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist

from optimus.config import ModelConfig, OptimusConfig, ParallelConfig, TrainConfig
from optimus.model import Transformer, build_model
from optimus.parallel import ParallelState
from optimus.parallel.parallelize import parallelize


def rank_model(
    cfg: ModelConfig, ps: ParallelState | None = None, *, seed: int = 0, dtype: str = "fp32",
    activation_checkpointing: str = "none", kernels: str = "torch",
) -> Transformer:  # fmt: skip
    """This rank's part of the model `cfg` under the layout of `ps` (one process when None), initialised from `seed`,
    with parameters in `dtype` (fp32 or bf16): what the trainer's optimizer and checkpoints see."""
    ps = ps or ParallelState()
    run = OptimusConfig(
        model=cfg,
        kernels=kernels,
        parallel=ParallelConfig(ep=ps.ep, tp=ps.tp, sp=ps.sp or ps.tp == 1, pp=ps.pp),
        train=TrainConfig(seed=seed, dtype=dtype, activation_checkpointing=activation_checkpointing),
    )
    return parallelize(build_model(cfg, kernels), ps, run, "cpu").module


@contextmanager
def fake_process_group(world: int, rank: int):
    """This process as rank `rank` of `world` on torch's fake process group: groups and meshes of any layout can
    be built, and every collective completes at once without moving data (no other process takes part)."""
    from optimus.kernels.torch_private import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
