"""Meta-device build: a rank allocates only its own experts, with the values a single process would have."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from optimus.config import ConfigError, ModelConfig, MoEConfig
from optimus.model import Transformer
from optimus.parallel import build_parallel_state
from tests.builds import fake_process_group, rank_model

SEED = 7


def small_config(n_experts: int = 8, **overrides) -> ModelConfig:
    base = dict(n_layers=3, dim=32, n_heads=4, n_kv_heads=2, vocab_size=100, ffn_dim=48, first_k_dense=1)
    base.update(overrides)
    return ModelConfig(moe=MoEConfig(n_experts=n_experts, top_k=2, expert_dim=24, n_shared_experts=1), **base)


@pytest.fixture(scope="module")
def single_process_model() -> Transformer:
    """The reference: the whole model on the CPU, initialised in one process."""
    model = Transformer(small_config(), kernels="torch")
    model.init_weights(SEED)
    return model


@pytest.mark.parametrize("ep", [2, 4])
def test_rank_holds_its_slice_of_the_single_process_model(single_process_model, ep):
    reference = dict(single_process_model.named_parameters())
    for ep_rank in range(ep):
        with fake_process_group(ep, ep_rank):
            model = rank_model(small_config(), build_parallel_state(ep), seed=SEED)
        n_local = 8 // ep
        for name, param in model.named_parameters():
            assert param.device.type == "cpu", name
            expected = reference[name]
            if ".experts." in name:
                expected = expected[ep_rank * n_local : (ep_rank + 1) * n_local]
            assert torch.equal(param, expected), f"ep={ep} rank {ep_rank}: {name}"
        for moe in model.moe_layers:
            assert moe.experts.n_experts == n_local and moe.experts.expert_offset == ep_rank * n_local
            assert torch.equal(moe.router.expert_bias, torch.zeros(8))


def test_bf16_parameters_are_the_fp32_values_rounded(single_process_model):
    model = rank_model(small_config(), dtype="bf16", seed=SEED)
    reference = dict(single_process_model.named_parameters())
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16, name
        assert torch.equal(param, reference[name].to(torch.bfloat16)), name
    assert all(buffer.dtype == torch.float32 for buffer in model.buffers())  # router bias stays fp32


def test_initial_values_depend_on_name_and_seed_only():
    """A parameter's values do not depend on which other parameters exist, nor on the process."""
    three = rank_model(small_config(), seed=SEED)
    five = rank_model(small_config(n_layers=5), seed=SEED)  # more layers, and shifted draw order
    assert torch.equal(three.layers["1"].attn.wq.weight, five.layers["1"].attn.wq.weight)
    assert torch.equal(three.embed.weight, five.embed.weight)
    assert not torch.equal(three.layers["1"].attn.wq.weight, three.layers["2"].attn.wq.weight)
    other_seed = rank_model(small_config(), seed=SEED + 1)
    assert not torch.equal(three.embed.weight, other_seed.embed.weight)
    # The same values in a fresh interpreter, whose string hashing is salted differently.
    code = (
        "import torch; from tests.model.test_model_build import small_config, SEED; "
        "from tests.builds import rank_model; "
        "m = rank_model(small_config(), seed=SEED); "
        "print(m.layers['2'].ffn.experts.w2[3, :2, :2].tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == three.layers["2"].ffn.experts.w2[3, :2, :2].tolist()


def test_tied_embeddings_stay_tied():
    model = rank_model(small_config(tie_embeddings=True), seed=SEED)
    assert model.lm_head.weight is model.embed.weight


def test_indivisible_expert_count_is_a_config_error():
    with pytest.raises(ConfigError, match="not divisible by parallel.ep=3"), fake_process_group(3, 0):
        rank_model(small_config(), build_parallel_state(3))


def test_a_pipeline_stage_of_dense_layers_only_builds_under_expert_parallelism(single_process_model):
    """pp = 2, ep = 2, the first two of four layers dense: pipeline rank 0's stage holds no MoE layer (nothing
    for expert parallelism to split there), and pipeline rank 1's holds its EP rank's half of each layer's
    experts. Found by the layout fuzzer (interleaved stages of one dense layer each)."""
    cfg = small_config(n_layers=4, first_k_dense=2)
    reference = Transformer(cfg, kernels="torch")
    reference.init_weights(SEED)
    whole = dict(reference.named_parameters())
    for rank in range(4):  # pipeline ranks 0 0 1 1 (stages of two ranks each), EP ranks 0 1 0 1
        with fake_process_group(4, rank):
            model = rank_model(cfg, build_parallel_state(ep=2, pp=2), seed=SEED)
        ep_rank = rank % 2
        assert [name for name, m in model.layers.items() if m.is_moe] == ([] if rank < 2 else ["2", "3"])
        for name, param in model.named_parameters():
            expected = whole[name][ep_rank * 4 : (ep_rank + 1) * 4] if ".experts." in name else whole[name]
            assert torch.equal(param, expected), f"rank {rank}: {name}"


# Peak resident memory of a child process that builds EP rank 0 of 2's model, read by the child itself
# after the build. VmHWM (optimus.device_memory.peak_resident_bytes) counts the child's own process image only:
# getrusage's ru_maxrss would start from this test runner's peak, which fork and exec carry over.
_PEAK_CHILD = """
import sys
from optimus.config import ModelConfig, MoEConfig
from optimus.parallel import build_parallel_state
from optimus.device_memory import peak_resident_bytes
from tests.builds import fake_process_group, rank_model
cfg = ModelConfig(n_layers=1, dim=256, n_heads=4, n_kv_heads=4, vocab_size=128, ffn_dim=256,
                  moe=MoEConfig(n_experts=int(sys.argv[1]), top_k=2, expert_dim=256))
with fake_process_group(2, 0):
    model = rank_model(cfg, build_parallel_state(2))
print(peak_resident_bytes())
"""


def _peak_rss_of_build(n_experts: int) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, str(n_experts)], capture_output=True, text=True, check=True
    )
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM (/proc/self/status) is Linux-only")
def test_more_experts_grow_a_rank_by_its_own_share_only():
    small, large = 8, 136
    expert_bytes = 3 * 256 * 256 * 4  # w13 (D x 2F) and w2 (F x D), fp32
    own_share = (large - small) // 2 * expert_bytes  # 64 more experts on this rank: 48 MiB
    peaks = {n: _peak_rss_of_build(n) for n in (small, large)}
    growth = peaks[large] - peaks[small]
    if not 0.8 * own_share < growth < 1.25 * own_share:
        # Memory pressure from other processes can evict a child's library pages (lowering its RSS,
        # never raising it): measure once more and keep each size's larger peak.
        peaks = {n: max(peak, _peak_rss_of_build(n)) for n, peak in peaks.items()}
        growth = peaks[large] - peaks[small]
    # Building the whole model and slicing it would grow the peak by twice the share.
    assert 0.8 * own_share < growth < 1.25 * own_share, (growth / 2**20, own_share / 2**20)


@pytest.mark.parametrize("scheme,world,ep,zero", [("none", 1, 1, 1), ("ep_aware", 4, 2, 1), ("standard", 4, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_adopts_the_built_parameters_without_a_copy(scheme, world, ep, zero, dtype):
    """The parameters stay where parallelize put them: the optimizer's flat buffers are their storage."""
    from optimus.config import OptimConfig
    from optimus.optim import ShardedAdamW

    with fake_process_group(world, world - 1):
        ps = build_parallel_state(ep)
        model = rank_model(small_config(), ps, dtype="bf16" if dtype == torch.bfloat16 else "fp32", seed=SEED)
        before = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
        opt = ShardedAdamW(model, OptimConfig(zero=zero, bucket_mb=0.01), ps, 1.0, scheme)
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name][0], name  # not moved
        assert torch.equal(p, before[name][1]), name
    for group in opt.sharder.groups.values():
        flat = group.flat
        assert all(s.param.data_ptr() == flat.buffer.data_ptr() + s.start * flat.buffer.element_size()
                   for s in flat.slots)  # fmt: skip
        assert not flat.buffer[flat.numel :].any()  # padding is zero
