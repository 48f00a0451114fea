"""The planner against what runs measure (run_info.json) and against hand-computed formulas."""

from __future__ import annotations

import json
import os

import pytest
import torch

from optimus.cli import load_config, main
from optimus.config import ConfigError, ModelConfig, MoEConfig, OptimusConfig
from optimus.model import Transformer, count_params, flops_per_token
from optimus.optim import ShardedAdamW, rank_state_bytes
from optimus.parallel import ParallelState
from optimus.parallel.expert_parallel import shard_experts
from optimus.plan import activation_bytes, make_plan
from optimus.train.trainer import Trainer
from tests.conftest import TINY_MODEL
from tests.distributed import run_distributed
from tests.optim.test_optimizer_memory import held_bytes

RUN = [
    *TINY_MODEL, "data=text", "train.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
    "train.eval_sequences=4", "machine.peak_flops=1e12",  # a fixed peak skips the CPU matmul probe
]  # fmt: skip
LAYOUTS = {  # name: (world, overrides); the sharded ones need expert parallelism and the EP-aware optimizer
    "1-fp32": (1, ["optim.sharding=none", "train.dtype=fp32"]),
    "1-bf16": (1, ["optim.sharding=none", "train.dtype=bf16"]),
    "2-fp32": (2, ["parallel.nproc=2", "parallel.ep=2", "optim.sharding=ep_aware", "optim.zero=1", "train.dtype=fp32"]),
    "4-bf16": (4, ["parallel.nproc=4", "parallel.ep=2", "optim.sharding=ep_aware", "optim.zero=2", "train.dtype=bf16"]),
}
STATE_KEYS = ("param_bytes", "grad_bytes", "master_bytes", "optim_state_bytes")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (see tests/conftest.py)


def write_run_info(overrides: list[str], cache: str) -> None:
    """One rank: set up the trainer exactly as `optimus train` does and write run_info.json (no steps)."""
    os.environ["OPTIMUS_CACHE"] = cache  # forked ranks share the test session's tokenizer cache
    trainer = Trainer(load_config(overrides))
    try:
        trainer.write_run_info()
    finally:
        trainer.loader.close()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_plan_matches_measured_state_bytes(tmp_path, corpus_file, layout):
    run_dir = tmp_path / "run"
    world, extra = LAYOUTS[layout]
    overrides = [*RUN, f"data.path={corpus_file}", f"run.dir={run_dir}", *extra]
    if world == 1:
        write_run_info(overrides, os.environ["OPTIMUS_CACHE"])
    else:  # real gloo ranks with expert parallelism and the sharded optimizer
        run_distributed(write_run_info, world, overrides, os.environ["OPTIMUS_CACHE"])
    info = json.loads((run_dir / "run_info.json").read_text())
    measured = info["per_rank"]
    assert info["dtypes"] == {"param": extra[-1].split("=")[1], "grad": "fp32", "master": "fp32"}
    cfg = load_config(overrides)
    plan = make_plan(cfg, world)
    predicted = plan.state[cfg.optim.sharding]
    assert len(measured) == world
    for rank_bytes in measured:
        for key in STATE_KEYS:
            assert abs(predicted[key] - rank_bytes[key]) <= 0.01 * rank_bytes[key], (world, key, rank_bytes)


def test_plan_matches_measured_state_bytes_per_pipeline_stage(tmp_path, corpus_file):
    """pp=2 x ep=2 on 4 gloo ranks, an uneven stage split: each pipeline rank's planned state bytes equal
    what the ranks of that stage hold (run_info.json), and the stages differ (the plan is per stage)."""
    run_dir = tmp_path / "run"
    layout = ["parallel.nproc=4", "parallel.pp=2", "parallel.ep=2", "parallel.pp_layers=[1,3]", "model.n_layers=4"]
    extra = [*layout, "optim.sharding=ep_aware", "optim.zero=2", "train.dtype=fp32"]
    overrides = [*RUN, f"data.path={corpus_file}", f"run.dir={run_dir}", *extra]
    run_distributed(write_run_info, 4, overrides, os.environ["OPTIMUS_CACHE"])
    measured = json.loads((run_dir / "run_info.json").read_text())["per_rank"]
    plan = make_plan(load_config(overrides), 4)
    assert [row["layers"] for row in plan.stages] == [[0], [1, 2, 3]]
    assert plan.stages[0]["state_bytes"] != plan.stages[1]["state_bytes"]
    for rank, rank_bytes in enumerate(measured):
        stage = plan.stages[rank // 2]  # ranks 0-1 hold stage 0, ranks 2-3 stage 1
        assert sum(rank_bytes[k] for k in STATE_KEYS) == stage["state_bytes"], rank


@pytest.mark.parametrize("experiment,pp", [("aurora-mula-100b-a7b", 4), ("aurora-mula-220b-a10b", 8)])
def test_full_size_pipeline_experiments_fit_an_aurora_tile(experiment, pp):
    """256 Aurora nodes: every pipeline rank of the 100B (PP 4) and 220B (PP 8) recipes fits its 64 GB tile,
    the stages hold every layer once, in order, and the 1F1B warm-up leaves the most activations on rank 0."""
    cfg = load_config([f"experiment={experiment}"])
    plan = make_plan(cfg, 256 * cfg.machine.ranks_per_node)
    assert plan.pp == pp and len(plan.stages) == pp
    assert [i for row in plan.stages for i in row["layers"]] == list(range(cfg.model.n_layers))
    assert plan.stages[0]["embed"] and plan.stages[-1]["head"]
    assert [row["in_flight"] for row in plan.stages] == list(range(pp, 0, -1))
    assert all(row["fits"] for row in plan.stages) and plan.memory["fits_configured"]
    assert plan.memory["total_configured"] == max(row["total_bytes"] for row in plan.stages)


SMALL = ModelConfig(
    n_layers=3, dim=64, n_heads=4, n_kv_heads=2, vocab_size=500, ffn_dim=96, first_k_dense=1,
    moe=MoEConfig(n_experts=8, top_k=2, expert_dim=48, n_shared_experts=1),
)  # fmt: skip


def rank_model(ps: ParallelState, dtype: torch.dtype) -> Transformer:
    model = Transformer(SMALL, kernels="torch").to(dtype)
    for moe in model.moe_layers:
        shard_experts(moe, ps.ep, ps.ep_rank)
    return model


@pytest.mark.parametrize("world,ep", [(4, 2), (12, 4)])
@pytest.mark.parametrize("scheme", ["none", "ep_aware", "standard"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [1, 2])
def test_plan_equals_the_buffers_the_optimizer_holds(world, ep, scheme, dtype, zero):
    """Every rank of many layouts, built in one process (building the optimizer runs no collective)."""
    cfg = OptimusConfig(model=SMALL)
    cfg.parallel.ep, cfg.train.dtype, cfg.optim.zero = ep, dtype, zero
    cfg.train.micro_batch, cfg.train.global_batch = 1, world
    predicted = make_plan(cfg, world).state[scheme]
    for rank in (0, world - 1):
        ps = ParallelState(rank=rank, world_size=world, ep=ep)
        model = rank_model(ps, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
        opt = ShardedAdamW(model, cfg.optim, ps, 1.0, scheme)
        assert sum(predicted[k] for k in STATE_KEYS) == held_bytes(opt)
        assert opt.memory_bytes() == predicted


def test_state_bytes_scale_as_documented():
    """Without padding (sizes divisible by everything): the per-parameter byte counts of the docstring."""
    dense, expert, world, ep = 2**20, 2**22, 8, 4
    dp, local = world // ep, dense + expert // ep
    none = rank_state_bytes("none", dense, expert // ep, world, dp, 4, 4, zero=1)
    assert (none.param_bytes, none.grad_bytes, none.master_bytes, none.optim_state_bytes) == (
        4 * local, 4 * local, 0, 8 * local,
    )  # fmt: skip
    ep_aware = rank_state_bytes("ep_aware", dense, expert // ep, world, dp, 2, 4, zero=2)
    assert ep_aware.param_bytes == 2 * local
    assert ep_aware.grad_bytes == 4 * (dense + expert) // world
    assert ep_aware.master_bytes == 4 * (dense + expert) // world
    assert ep_aware.optim_state_bytes == 8 * (dense + expert) // world
    standard = rank_state_bytes("standard", dense, expert // ep, world, dp, 4, 4, zero=1)
    assert standard.optim_state_bytes == 8 * (dense // dp + expert // world)
    assert standard.grad_bytes == 4 * local + 4 * (dense // dp + expert // world)


def test_activation_bytes_by_hand():
    """bf16, QK-norm on: the per-token counts of the module docstring, mode by mode (measured in
    tests/train/test_activation_checkpointing.py)."""
    t, a = 2 * 16, 2  # micro_batch 2, seq_len 16, bf16
    d, d_kv, n, k, f, fs, e, ffn, v = 64, 32, 4, 2, 48, 48, 8, 96, 512  # vocab 500 pads to 512
    norms, attn = 6 * d * a, (5 * d + 4 * d_kv) * a + 4 * n
    router, rows, experts, shared = 4 * d + 8 * e + 28 * k, 2 * k * d * a, 4 * k * f * a, 4 * fs * a
    dense, moe = norms + attn + 4 * ffn * a, norms + attn + router + rows + experts + shared
    # the fused cross-entropy keeps the logits' gradient in bf16; the plain one logits and fp32 log-probs
    head = {True: 3 * d * a + v * a + 16, False: 3 * d * a + v * (a + 4) + 16}
    for fused in (True, False):
        kept = {  # one dense block, then two MoE blocks
            "none": dense + 2 * moe + head[fused],
            "selective": dense - attn + 2 * (moe - attn) + head[fused],
            "full": d * a + 2 * (norms + router + rows) + head[fused],
        }
        # the plain head's backward starts with the logits' gradient (fp32 and its bf16 cast), larger here than
        # any recomputed region; the fused head's kept bytes exceed every block's recomputed region
        logits_grad = 0 if fused else v * (4 + a)
        for mode, per_token in kept.items():
            got = activation_bytes(SMALL, 2, 16, a, mode, recompute=False, fused_head=fused)
            assert got == t * per_token, (mode, fused)
            assert activation_bytes(SMALL, 2, 16, a, mode, fused_head=fused) == t * (per_token + logits_grad), mode


def test_flops_and_fit(tmp_path):
    cfg = load_config([*TINY_MODEL, "machine.memory_gb=0.01", "train.dtype=fp32"])
    counts = count_params(Transformer(cfg.model, kernels="torch"), cfg.model)
    plan = make_plan(cfg, 1)
    per_step = flops_per_token(counts, cfg.model, cfg.train.seq_len) * cfg.train.global_batch * cfg.train.seq_len
    assert plan.flops["per_step"] == pytest.approx(per_step)
    total = plan.memory["total_no_checkpointing"]
    assert total == sum(plan.state["none"][k] for k in STATE_KEYS) + plan.activations["no_checkpointing"]
    assert plan.memory["fits_no_checkpointing"] == (total <= 0.01 * 2**30)
    roomy = make_plan(load_config([*TINY_MODEL, "machine.memory_gb=64"]), 1)
    assert roomy.memory["fits_no_checkpointing"] and roomy.memory["fits_checkpointing"]


def test_plan_cli(capsys):
    args = ["parallel.ep=2", "optim.sharding=ep_aware", "train.micro_batch=2", "--world", "4", "--json"]
    assert main(["plan", *TINY_MODEL, *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["world"], out["dp"], out["ep"], out["sharding"]) == (4, 2, 2, "ep_aware")
    assert main(["plan", *TINY_MODEL, "--nodes", "2"]) == 2  # machine=local has no ranks_per_node
    assert "--world" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="parallel.ep"):
        make_plan(load_config([*TINY_MODEL, "parallel.ep=3", "train.micro_batch=1", "train.global_batch=6"]), 6)
