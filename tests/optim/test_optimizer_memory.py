"""Per-rank memory and ownership of the sharded optimizer, against the formulas, for every rank of a layout.

Building the optimizer runs no collective, so each rank of a layout is built here in
one process from a ParallelState that only names its position (no process groups).
"""

from __future__ import annotations

import pytest
import torch

from optimus.config import ModelConfig, MoEConfig, OptimConfig, OptimusConfig
from optimus.layout import Layout
from optimus.model import Transformer, count_params
from optimus.optim import ShardedAdamW, ShardedMuon, build_optimizer
from optimus.parallel import ParallelState
from optimus.parallel.expert_parallel import shard_experts

MODEL = ModelConfig(
    n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128,
    moe=MoEConfig(n_experts=8, top_k=2, expert_dim=128, n_shared_experts=1),
)  # fmt: skip
LAYOUTS = [(2, 1), (4, 2), (4, 4), (8, 4), (16, 8)]  # (world, ep)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (see tests/conftest.py)


def rank_model(ps: ParallelState, dtype: torch.dtype) -> Transformer:
    """This rank's slice of the model, as expert parallelism leaves it (no dispatcher needed to count bytes)."""
    with torch.device("cpu"):
        model = Transformer(MODEL, kernels="torch").to(dtype)
    for moe in model.moe_layers:
        shard_experts(moe, ps.ep, ps.ep_rank)
    return model


def owner_ranks(scheme: str, world: int, ep: int) -> dict[str, int]:
    """Ranks that split each group's optimizer state (the table in optimus.optim.sharded)."""
    dp = world // ep
    return {"dense": {"none": 1, "standard": dp, "ep_aware": world}[scheme], "expert": 1 if scheme == "none" else dp}


def held_bytes(opt: ShardedAdamW) -> int:
    """Bytes of every distinct buffer the optimizer holds (a buffer used twice counts once)."""
    storages = {}
    for g in opt.sharder.groups.values():
        for t in (g.flat.buffer, g.full_grad, g.grad_shard, g.master):
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for t in opt.rule.tensors():
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("world,ep", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["none", "ep_aware", "standard"])
@pytest.mark.parametrize("zero", [1, 2])
def test_state_bytes_match_formula_and_the_buffers_held(world, ep, dtype, scheme, zero):
    cfg = OptimConfig(zero=zero, bucket_mb=0.05)  # several buckets per group; fp32 gradients
    for rank in range(world):
        ps = ParallelState(rank=rank, layout=Layout(world=world, ep=ep))
        model = rank_model(ps, dtype)
        counts = count_params(model, MODEL)
        local = sum(p.numel() for p in model.parameters())
        opt = ShardedAdamW(model, cfg, ps, 1.0, scheme)
        mem = opt.memory_bytes()
        owners = owner_ranks(scheme, world, ep)
        local_numel = {"dense": counts.dense, "expert": counts.expert / ep}
        owned = sum(local_numel[k] / owners[k] for k in owners)
        pad = mem["padding_bytes"]
        assert abs(mem["optim_state_bytes"] - 8 * owned) <= pad, (rank, mem, owned)  # two fp32 moments
        es = torch.finfo(dtype).bits // 8
        assert abs(mem["master_bytes"] - (4 * owned if es != 4 else 0)) <= pad  # fp32 master of bf16 params
        total = mem["param_bytes"] + mem["grad_bytes"] + mem["master_bytes"] + mem["optim_state_bytes"]
        assert pad < 0.005 * total
        assert total == held_bytes(opt)
        assert 0 <= mem["param_bytes"] - local * es <= pad
        # ZeRO-1 keeps the full fp32 gradients, plus the reduced shard where others own the rest; ZeRO-2 the shard.
        full = local * 4 if zero == 1 else 0
        shard = sum(4 * local_numel[k] / owners[k] for k in owners if zero == 2 or owners[k] > 1)
        assert abs(mem["grad_bytes"] - full - shard) <= pad, (rank, mem)


def test_one_owner_holds_each_gradient_once():
    """ep_aware with ep = world: the expert group has one owner, so ZeRO-1 keeps one expert gradient buffer."""
    ps = ParallelState(rank=1, layout=Layout(world=4, ep=4))
    opt = ShardedAdamW(rank_model(ps, torch.float32), OptimConfig(zero=1), ps, 1.0, "ep_aware")
    expert = opt.sharder.groups["expert"]
    assert expert.grad_shard is expert.full_grad
    assert expert.state_bytes(opt.rule.state_bytes_per_element).grad_bytes == 4 * expert.flat.padded_numel


@pytest.mark.parametrize("world,ep", LAYOUTS)
@pytest.mark.parametrize("scheme", ["none", "ep_aware", "standard"])
def test_every_element_is_owned_once(world, ep, scheme):
    """state_dict ranges, keyed in the full (all-experts) parameter: ep_aware tiles every parameter exactly once;
    standard repeats each dense range on the EP ranks of a DP group and tiles the experts once; none replicates."""
    full = Transformer(MODEL, kernels="torch")
    numel = {n: p.numel() for n, p in full.named_parameters()}
    owners: dict[str, list[tuple[int, int]]] = {n: [] for n in numel}
    for rank in range(world):
        ps = ParallelState(rank=rank, layout=Layout(world=world, ep=ep))
        state = ShardedAdamW(
            rank_model(ps, torch.float32), OptimConfig(bucket_mb=0.05, zero=2), ps, 1.0, scheme
        ).state_dict()
        for key, entry in state["shards"].items():
            assert key == f"{entry['name']}[{entry['lo']}:{entry['hi']}]"
            assert entry["exp_avg"].numel() == entry["hi"] - entry["lo"]
            owners[entry["name"]].append((entry["lo"], entry["hi"]))
    for name, ranges in owners.items():
        if scheme == "none":  # every rank holds every element it has: dense on all ranks, experts on their DP peers
            copies = world if ".experts." not in name else world // ep
        else:
            copies = ep if scheme == "standard" and ".experts." not in name else 1
        covered = torch.zeros(numel[name], dtype=torch.int64)
        for lo, hi in ranges:
            covered[lo:hi] += 1
        assert torch.all(covered == copies), name


@pytest.mark.parametrize("world,ep,shard_ranks", [(4, 1, 2), (8, 2, 2), (8, 4, 1)])
def test_with_shard_ranks_each_shard_group_owns_every_element_once(world, ep, shard_ranks):
    """optim.shard_ranks (ep_aware): the ranks of each shard group tile every parameter exactly once, so each
    element has one owner per shard group: world / S of them (dense), world / (ep x S) (experts)."""
    full = Transformer(MODEL, kernels="torch")
    covered = {n: torch.zeros(p.numel(), dtype=torch.int64) for n, p in full.named_parameters()}
    for rank in range(world):
        ps = ParallelState(rank=rank, layout=Layout(world=world, ep=ep, shard_ranks=shard_ranks))
        opt = ShardedAdamW(rank_model(ps, torch.float32), OptimConfig(bucket_mb=0.05, zero=2), ps, 1.0, "ep_aware")
        for entry in opt.state_dict()["shards"].values():
            covered[entry["name"]][entry["lo"] : entry["hi"]] += 1
    for name, counts in covered.items():
        copies = world // shard_ranks // (ep if ".experts." in name else 1)
        assert torch.all(counts == copies), name


def test_build_optimizer_auto_picks_by_world_size():
    cfg = OptimusConfig(model=MODEL)
    cfg.optim.sharding = "auto"
    single = ParallelState()
    assert build_optimizer(rank_model(single, torch.float32), cfg, single).scheme == "none"
    ps = ParallelState(rank=1, layout=Layout(world=4, ep=2))
    opt = build_optimizer(rank_model(ps, torch.float32), cfg, ps)
    assert type(opt) is ShardedMuon and opt.scheme == "ep_aware"  # the default rule
    cfg.optim.sharding, cfg.optim.update = "standard", "adamw"
    opt = build_optimizer(rank_model(ps, torch.float32), cfg, ps)
    assert type(opt) is ShardedAdamW and opt.scheme == "standard"


def test_buckets_respect_the_collective_limit_and_params_view_the_flat_buffer():
    ps = ParallelState(rank=2, layout=Layout(world=4, ep=2))
    model = rank_model(ps, torch.bfloat16)
    opt = ShardedAdamW(model, OptimConfig(zero=1, max_collective_numel=5000, grad_dtype="bf16"), ps, 1.0, "ep_aware")
    for group in opt.sharder.groups.values():
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
    slots = {s.name for g in opt.sharder.groups.values() for s in g.flat.slots}
    assert {n for n, _ in model.named_parameters()} == slots
