"""Per-rank memory and ownership of the sharded optimizer, against the formulas, for every rank of a layout.

Building the optimizer runs no collective, so each rank of a layout is built here in
one process from a ParallelState that only names its position (no process groups).
"""

from __future__ import annotations

import pytest
import torch

from optimus.config import ModelConfig, MoEConfig, OptimConfig, OptimusConfig
from optimus.model import Transformer, count_params
from optimus.optim import ReplicatedAdamW, ShardedAdamW, build_optimizer
from optimus.parallel import ParallelState
from optimus.parallel.expert_parallel import shard_experts

MODEL = ModelConfig(
    n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128,
    moe=MoEConfig(n_experts=8, top_k=2, expert_dim=128, n_shared_experts=1),
)  # fmt: skip
LAYOUTS = [(2, 1), (4, 2), (4, 4), (8, 4), (16, 8)]  # (world, ep)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: extra threads only contend with whatever else runs on the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rank_model(ps: ParallelState, dtype: torch.dtype) -> Transformer:
    """This rank's slice of the model, as expert parallelism leaves it (no dispatcher needed to count bytes)."""
    with torch.device("cpu"):
        model = Transformer(MODEL, kernels="torch").to(dtype)
    for moe in model.moe_layers:
        shard_experts(moe, ps.ep, ps.ep_rank)
    return model


def formula_state_bytes(scheme: str, dense: int, expert: int, world: int, ep: int, per_param: int) -> float:
    dp = world // ep
    dense_share = dense / world if scheme == "ep_aware" else dense / dp
    return per_param * (dense_share + expert / world)  # experts: (expert / ep) / dp


@pytest.mark.parametrize("world,ep", LAYOUTS)
@pytest.mark.parametrize("dtype,per_param", [(torch.float32, 8), (torch.bfloat16, 12)])
@pytest.mark.parametrize("scheme", ["ep_aware", "standard"])
@pytest.mark.parametrize("zero", [1, 2])
def test_optim_state_bytes_match_formula(world, ep, dtype, per_param, scheme, zero):
    cfg = OptimConfig(zero=zero, bucket_mb=0.05)  # several buckets per group
    for rank in range(world):
        ps = ParallelState(rank=rank, world_size=world, ep=ep)
        model = rank_model(ps, dtype)
        counts = count_params(model, MODEL)
        local = sum(p.numel() for p in model.parameters())
        mem = ShardedAdamW(model, cfg, ps, 1.0, scheme).memory_bytes()
        formula = formula_state_bytes(scheme, counts.dense, counts.expert, world, ep, per_param)
        pad = mem["padding_bytes"]
        assert abs(mem["optim_state_bytes"] - formula) <= pad, (rank, mem, formula)
        total = mem["param_bytes"] + mem["grad_bytes"] + mem["optim_state_bytes"]
        assert pad < 0.005 * total
        es = torch.finfo(dtype).bits // 8
        assert 0 <= mem["param_bytes"] - local * es <= pad
        dense_shard = counts.dense / (world if scheme == "ep_aware" else world // ep)
        shard_bytes = es * (dense_shard + counts.expert / world)
        full = local * es if zero == 1 else 0  # ZeRO-1 keeps the full gradients too; ZeRO-2 only the shard
        assert abs(mem["grad_bytes"] - full - shard_bytes) <= pad


@pytest.mark.parametrize("world,ep", LAYOUTS)
@pytest.mark.parametrize("scheme", ["ep_aware", "standard"])
def test_every_element_is_owned_once(world, ep, scheme):
    """state_dict ranges, keyed in the full (all-experts) parameter: ep_aware tiles every parameter exactly once;
    standard repeats each dense range on the EP ranks of a DP group and tiles the experts once."""
    full = Transformer(MODEL, kernels="torch")
    numel = {n: p.numel() for n, p in full.named_parameters()}
    owners: dict[str, list[tuple[int, int]]] = {n: [] for n in numel}
    for rank in range(world):
        ps = ParallelState(rank=rank, world_size=world, ep=ep)
        state = ShardedAdamW(
            rank_model(ps, torch.float32), OptimConfig(bucket_mb=0.05, zero=2), ps, 1.0, scheme
        ).state_dict()
        for key, entry in state["shards"].items():
            assert key == f"{entry['name']}[{entry['lo']}:{entry['hi']}]"
            assert entry["exp_avg"].numel() == entry["hi"] - entry["lo"]
            owners[entry["name"]].append((entry["lo"], entry["hi"]))
    for name, ranges in owners.items():
        copies = ep if scheme == "standard" and ".experts." not in name else 1
        covered = torch.zeros(numel[name], dtype=torch.int64)
        for lo, hi in ranges:
            covered[lo:hi] += 1
        assert torch.all(covered == copies), name


def test_build_optimizer_auto_picks_by_world_size():
    cfg = OptimusConfig(model=MODEL)
    cfg.optim.sharding = "auto"
    single = ParallelState()
    assert isinstance(build_optimizer(rank_model(single, torch.float32), cfg, single), ReplicatedAdamW)
    ps = ParallelState(rank=1, world_size=4, ep=2)
    opt = build_optimizer(rank_model(ps, torch.float32), cfg, ps)
    assert isinstance(opt, ShardedAdamW) and opt.scheme == "ep_aware"
    cfg.optim.sharding = "standard"
    assert build_optimizer(rank_model(ps, torch.float32), cfg, ps).scheme == "standard"


def test_buckets_respect_the_collective_limit_and_params_view_the_flat_buffer():
    ps = ParallelState(rank=2, world_size=4, ep=2)
    model = rank_model(ps, torch.bfloat16)
    opt = ShardedAdamW(model, OptimConfig(zero=1, max_collective_numel=5000), ps, 1.0, "ep_aware")
    for group in opt.groups.values():
        flat = group.flat
        assert len(flat.buckets) > 1 and flat.buckets[0].start == 0 and flat.buckets[-1].end == flat.padded_numel
        for a, b in zip(flat.buckets, flat.buckets[1:]):
            assert a.end == b.start
        for b in flat.buckets:  # one collective per bucket: never above the limit, equal 128-byte slices per rank
            assert b.end - b.start <= 5000 and (b.end - b.start) % (flat.world * 64) == 0
        base = flat.buffer.data_ptr()
        for s in flat.slots:
            assert s.param.data_ptr() == base + s.start * flat.buffer.element_size()
            assert s.param.grad.data_ptr() == group.full_grad.data_ptr() + s.start * flat.buffer.element_size()
    assert {n for n, _ in model.named_parameters()} == {s.name for g in opt.groups.values() for s in g.flat.slots}
