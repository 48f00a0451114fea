"""The planner against what runs measure (run_info.json) and against hand-computed formulas."""

from __future__ import annotations

import json
import os
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from optimus.cli import load_config, main
from optimus.config import ConfigError, ModelConfig, MoEConfig, OptimusConfig
from optimus.config_checks import layout_of
from optimus.layout import Layout
from optimus.model import Transformer, count_params, flops_per_token, padded_vocab_size
from optimus.model.loss import linear_cross_entropy
from optimus.optim import ShardedAdamW, rank_state_bytes
from optimus.parallel import ParallelState
from optimus.parallel.expert_parallel import shard_experts
from optimus.parallel.pipeline import stage_sizes
from optimus.parallel.tensor_parallel import local_tensor
from optimus.plan import activation_bytes, fused_head_work_bytes, make_plan
from optimus.train.trainer import Trainer
from tests.builds import rank_model
from tests.conftest import TINY_MODEL
from tests.distributed import run_distributed
from tests.optim.test_optimizer_memory import held_bytes
from tests.parallel.test_pipeline_held import heaviest_in_order, torch_order

RUN = [
    *TINY_MODEL, "data=text", "train.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
    "train.eval_sequences=4", "machine.peak_flops=1e12",  # a fixed peak skips the CPU matmul probe
]  # fmt: skip
LAYOUTS = {  # name: (world, overrides); the sharded ones need expert parallelism and the EP-aware optimizer
    "1-fp32": (1, ["optim.sharding=none", "train.dtype=fp32"]),
    "1-bf16": (1, ["optim.sharding=none", "train.dtype=bf16"]),
    "2-fp32": (2, ["parallel.nproc=2", "parallel.ep=2", "optim.sharding=ep_aware", "optim.zero=1", "train.dtype=fp32"]),
    "4-bf16": (4, ["parallel.nproc=4", "parallel.ep=2", "optim.sharding=ep_aware", "optim.zero=2", "train.dtype=bf16"]),
    # tensor parallelism: each rank holds half of the split weights; the dense state is over the 2 (1) ranks
    # with the same tp rank, the experts' over the ranks with the same experts
    "2-tp-fp32": (2, ["parallel.nproc=2", "parallel.tp=2", "model.moe.n_experts=0", "optim.sharding=ep_aware",
                      "optim.zero=1", "train.dtype=fp32"]),
    "4-tp-ep-fp32": (4, ["parallel.nproc=4", "parallel.tp=2", "parallel.ep=2", "parallel.sp=false",
                         "optim.sharding=standard", "optim.zero=2", "train.dtype=fp32"]),
}  # fmt: skip
STATE_KEYS = ("param_bytes", "grad_bytes", "master_bytes", "optim_state_bytes")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (see tests/conftest.py)


def write_run_info(overrides: list[str], cache: str) -> None:
    """One rank: set up the trainer exactly as `optimus train` does and write run_info.json (no steps)."""
    os.environ["OPTIMUS_CACHE"] = cache  # forked ranks share the test session's tokenizer cache
    trainer = Trainer.from_config(load_config(overrides))
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


@pytest.mark.parametrize("inner", ["parallel.ep=2", "parallel.tp=2"])
def test_plan_matches_measured_state_bytes_per_pipeline_stage(tmp_path, corpus_file, inner):
    """pp=2 x ep=2 and pp=2 x tp=2 on 4 gloo ranks, an uneven stage split: each pipeline rank's planned state
    bytes equal what the ranks of that stage hold (run_info.json), and the stages differ (the plan is per stage)."""
    run_dir = tmp_path / "run"
    layout = ["parallel.nproc=4", "parallel.pp=2", inner, "parallel.pp_layers=[1,3]", "model.n_layers=4"]
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


@pytest.mark.parametrize(
    "experiment,pp,schedule,micro_batches",
    [("aurora-mula-100b-a7b", 8, "interleaved_zb", 8), ("aurora-mula-220b-a10b", 8, "interleaved_zb", 8)],
)
def test_full_size_pipeline_experiments_fit_an_aurora_tile(experiment, pp, schedule, micro_batches):
    """256 Aurora nodes: every pipeline rank of the 100B (PP 8, zero bubble, TP 2, micro-batches of 2: one round of
    pp micro-batches per data-parallel rank) and 220B (PP 8, zero bubble, no TP: one round) recipes, two stages per
    rank, fits its 64 GB tile; the ranks hold every layer once; and each holds, in micro-batches of its layers,
    the heaviest point of torch's own action order for it (zero bubble: a forward held until its weight pass),
    each stage's forwards weighing its layers."""
    cfg = load_config([f"experiment={experiment}"])
    plan = make_plan(cfg, 256 * cfg.machine.ranks_per_node)
    v, t = cfg.parallel.pp_virtual, cfg.train
    runs = layout_of(cfg, 3072).micro_batches(t.global_batch, t.micro_batch)
    assert (plan.pp, len(plan.stages), cfg.parallel.pp_schedule, v, runs) == (pp, pp, schedule, 2, micro_batches)
    assert sorted(i for row in plan.stages for i in row["layers"]) == list(range(cfg.model.n_layers))
    assert plan.stages[0]["embed"] and plan.stages[-1]["head"]
    sizes = stage_sizes(cfg.model, pp * v)
    for r, row in enumerate(plan.stages):
        weights = [sizes[r + k * pp] for k in range(v)]
        heaviest = heaviest_in_order(torch_order(pp, v, micro_batches, r, schedule), pp, v, weights)
        assert row["in_flight"] == pytest.approx(heaviest / sum(weights), rel=1e-12), r
    assert all(row["fits"] for row in plan.stages) and plan.memory["fits_configured"]
    assert plan.memory["total_configured"] == max(row["total_bytes"] for row in plan.stages)


SMALL = ModelConfig(
    n_layers=3, dim=64, n_heads=4, n_kv_heads=2, vocab_size=500, ffn_dim=96, first_k_dense=1,
    moe=MoEConfig(n_experts=8, top_k=2, expert_dim=48, n_shared_experts=1),
)  # fmt: skip


def sliced_model(ps: ParallelState, dtype: torch.dtype) -> Transformer:
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
        ps = ParallelState(rank=rank, layout=Layout(world=world, ep=ep))
        model = sliced_model(ps, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
        opt = ShardedAdamW(model, cfg.optim, ps, 1.0, scheme)
        assert sum(predicted[k] for k in STATE_KEYS) == held_bytes(opt)
        assert opt.memory_bytes() == predicted


@pytest.mark.parametrize("world,ep,shard_ranks", [(4, 1, 2), (12, 2, 3), (8, 2, 1)])  # shard_ranks < edp
@pytest.mark.parametrize("scheme", ["ep_aware", "standard"])
@pytest.mark.parametrize("zero", [1, 2])
def test_plan_equals_the_buffers_the_optimizer_holds_with_shard_ranks(world, ep, shard_ranks, scheme, zero):
    """optim.shard_ranks: the plan counts the state split over groups of shard_ranks, as the sharder allocates it
    (more per rank than over every rank of the group)."""
    cfg = OptimusConfig(model=SMALL)
    cfg.parallel.ep, cfg.train.dtype, cfg.optim.zero, cfg.optim.sharding = ep, "bf16", zero, scheme
    cfg.train.micro_batch, cfg.train.global_batch = 1, world
    whole = make_plan(cfg, world).state[scheme]
    cfg.optim.shard_ranks = shard_ranks
    predicted = make_plan(cfg, world).state[scheme]
    assert predicted["optim_state_bytes"] > whole["optim_state_bytes"]
    for rank in (0, world - 1):
        ps = ParallelState(rank=rank, layout=Layout(world=world, ep=ep, shard_ranks=shard_ranks))
        opt = ShardedAdamW(sliced_model(ps, torch.bfloat16), cfg.optim, ps, 1.0, scheme)
        assert {kind: g.flat.world for kind, g in opt.sharder.groups.items()} == {
            "dense": shard_ranks,
            "expert": shard_ranks,
        }
        assert sum(predicted[k] for k in STATE_KEYS) == held_bytes(opt)
        assert opt.memory_bytes() == predicted


def test_state_bytes_scale_as_documented():
    """Without padding (sizes divisible by everything): the per-parameter byte counts of the docstring."""
    dense, expert, world, ep = 2**20, 2**22, 8, 4
    edp, local = world // ep, dense + expert // ep  # expert-data-parallel ranks, elements held
    stage, adamw = Layout(world=world, ep=ep), {"state_bytes_per_element": 8}  # AdamW: two fp32 moments
    none = rank_state_bytes("none", dense, expert // ep, stage, 4, 4, zero=1, **adamw)
    assert (none.param_bytes, none.grad_bytes, none.master_bytes, none.optim_state_bytes) == (
        4 * local, 4 * local, 0, 8 * local,
    )  # fmt: skip
    ep_aware = rank_state_bytes("ep_aware", dense, expert // ep, stage, 2, 4, zero=2, **adamw)
    assert ep_aware.param_bytes == 2 * local
    assert ep_aware.grad_bytes == 4 * (dense + expert) // world
    assert ep_aware.master_bytes == 4 * (dense + expert) // world
    assert ep_aware.optim_state_bytes == 8 * (dense + expert) // world
    standard = rank_state_bytes("standard", dense, expert // ep, stage, 4, 4, zero=1, **adamw)
    assert standard.optim_state_bytes == 8 * (dense // edp + expert // world)
    assert standard.grad_bytes == 4 * local + 4 * (dense // edp + expert // world)


def test_activation_bytes_by_hand():
    """bf16, QK-norm on: the per-token counts of the module docstring, mode by mode (measured in
    tests/train/test_activation_checkpointing.py)."""
    t, a = 2 * 16, 2  # micro_batch 2, seq_len 16, bf16
    d, d_kv, n, k, f, fs, e, ffn, v = 64, 32, 4, 2, 48, 48, 8, 96, 512  # vocab 500 pads to 512
    # norms: both pre-norms' input, the attention norm's output, the FFN's input; attention: q/k/v, SDPA's output
    # and the out-projection's input, and q/k before QK-norm
    norms, attn = 4 * d * a, (4 * d + 3 * d_kv) * a + 4 * n
    router, rows, experts, shared = 4 * d + 8 * e + 28 * k, 2 * k * d * a, 4 * k * f * a, 4 * fs * a
    dense, moe = norms + attn + 4 * ffn * a, norms + attn + router + rows + experts + shared
    # the fused cross-entropy keeps the logits' gradient in bf16 (every head runs it; tp = 1)
    head = 2 * d * a + v * a + 16
    assert t * v * (4 + a) > max(v * d * a + 2 * t * d * a, 10 * t * d)  # the fused head's forward chunk is largest
    kept = {  # one dense block, then two MoE blocks
        "none": dense + 2 * moe + head,
        "selective": dense - attn + 2 * (moe - attn) + head,
        "full": d * a + 2 * (norms + router + rows) + head,
    }
    # the fused head's kept bytes exceed every block's recomputed region, and its largest work is its forward's
    # chunk of t rows: fp32 logits and their bf16 GEMM output (above its backward's [v, d] and two [t, d] bf16
    # gradients, and the 2 + 4 + 4 bytes per [t, d] element of the scaled copy's making)
    head_work = t * v * (4 + a)
    # Without the head's work, the last MoE layer's is the peak. One rank (no exchange), torch's combine on its
    # k t = 64 rows: in the forward a widened copy of the rows and their weighted product, both fp32; in the
    # backward the rows' gradient in bf16, and for the weights' gradient (one block of all 64 rows) the gathered
    # output gradient in bf16, its and the rows' fp32 copies and their product; beside the two gradients [t, d].
    rows = k * t
    combine, combine_grad = rows * d * (4 + 4), rows * d * a + rows * d * (a + 4 + 4 + 4)
    for mode, per_token in kept.items():
        assert activation_bytes(SMALL, 2, 16, a, mode, recompute=False) == t * per_token, mode
        peak = t * per_token + head_work
        assert activation_bytes(SMALL, 2, 16, a, mode, head_work=True) == peak, mode
        below = per_token - head  # every block's, the last one an MoE block
        moe_peak = max(t * below + combine, t * (below + 2 * d * a) + combine_grad)
        assert moe_peak > t * per_token
        assert activation_bytes(SMALL, 2, 16, a, mode) == moe_peak, mode


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of the tensors that ops made under this mode and that are still alive, op by op, and their peak
    (a storage counts until it is freed, whichever tensors view it)."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.alive = self.peak = 0

    def _freed(self, key: int) -> None:
        self.alive -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        held = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}  # views, in-place
        for t in out if isinstance(out, (tuple, list)) else [out]:
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            new = storage is not None and storage.nbytes() and storage.data_ptr() not in held
            if new and storage.data_ptr() not in self.sizes:
                self.sizes[storage.data_ptr()] = storage.nbytes()
                self.alive += storage.nbytes()
                weakref.finalize(storage, self._freed, storage.data_ptr())
        self.peak = max(self.peak, self.alive)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_head_work_is_what_the_cross_entropy_allocates(dtype):
    """The fused cross-entropy's working memory beyond what it keeps for the backward (fp32: its backward's
    gradients; bf16: its forward's chunk of logits) against the live tensors its forward and backward make,
    tracked op by op, within 5%."""
    m = ModelConfig(dim=256, vocab_size=8192)
    tokens, vocab = 1024, padded_vocab_size(m.vocab_size)  # 4 chunks of rows
    gen = torch.Generator().manual_seed(0)
    h_TD = torch.randn(tokens, m.dim, generator=gen).to(dtype).requires_grad_()
    weight_VD = (0.02 * torch.randn(vocab, m.dim, generator=gen)).to(dtype).requires_grad_()
    targets_T = torch.randint(0, m.vocab_size, (tokens,), generator=gen)
    with LiveTensorBytes() as live:
        loss_T = linear_cross_entropy(h_TD, weight_VD, targets_T)
        kept = live.alive  # the logits' gradient it keeps for the backward, and the loss
        forward_work = live.peak - kept
        live.peak = 0
        loss_T.sum().backward()
        backward_work = live.peak - kept
    measured = max(forward_work, backward_work)
    assert fused_head_work_bytes(m, tokens, dtype.itemsize) == pytest.approx(measured, rel=0.05)


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
    assert (out["world"], out["dp"], out["tp"], out["ep"], out["edp"], out["sharding"]) == (4, 4, 1, 2, 2, "ep_aware")
    assert (
        main(["plan", *TINY_MODEL, "parallel.tp=2", "model.moe.n_experts=0", "train.micro_batch=2", "--world", "4"])
        == 0
    )
    assert "layout: world 4 = PP 1 x DP 2 x TP 2 with sequence parallelism\n" in capsys.readouterr().out
    assert main(["plan", *TINY_MODEL, "--nodes", "2"]) == 2  # machine=local has no ranks_per_node
    assert "--world" in capsys.readouterr().err
    # A layout that does not divide parallel.nproc, with neither --nodes nor --world: the refusal names both.
    assert main(["plan", *TINY_MODEL, "parallel.pp=2"]) == 2
    err = capsys.readouterr().err
    assert "parallel.pp=2 does not divide the world size 1" in err and "--nodes N or --world N" in err
    with pytest.raises(ConfigError, match="parallel.ep"):
        make_plan(load_config([*TINY_MODEL, "parallel.ep=3", "train.micro_batch=1", "train.global_batch=6"]), 6)


@pytest.mark.parametrize(
    "extra,heading",
    [
        (["train.micro_batch=1"], "activations per micro-batch of 1 sequence: train.activation_checkpointing=none "),
        (["train.micro_batch=2"], "activations per micro-batch of 2 sequences: train.activation_checkpointing=none "),
        (
            ["train.micro_batch=2", "parallel.pp=2", "--world", "2"],
            "activations of the busiest pipeline rank (its micro-batches in flight, of 2 sequences each): "
            "train.activation_checkpointing=none ",
        ),
    ],
)
def test_plan_activation_line_reads_as_a_sentence(capsys, extra, heading):
    """Parentheses balanced and "sequence" in the number of the count."""
    assert main(["plan", *TINY_MODEL, *extra]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("activations "))
    assert line.startswith(heading) and line.count("(") == line.count(")")


DENSE = ModelConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=500, ffn_dim=96, qk_norm="none",
                    moe=MoEConfig(n_experts=0))  # fmt: skip


def tp_cfg(model: ModelConfig, tp: int, sp: bool = True, **train) -> OptimusConfig:
    cfg = OptimusConfig(model=model)
    cfg.parallel.tp, cfg.parallel.sp, cfg.train.dtype = tp, sp, "bf16"
    cfg.train.micro_batch, cfg.train.global_batch, cfg.train.seq_len = 1, 8, 16
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


@pytest.mark.parametrize("model", [DENSE, SMALL], ids=["dense", "moe"])
def test_tensor_parallel_splits_attention_dense_ffn_embedding_and_head(model):
    """Per device, tp = 2 holds half of q/k/v/out (and full QK-norms), the dense SwiGLU, the embedding and the LM
    head (counted by hand from the shapes) and all of the rest; the optimizer state follows: the owned shard of
    the dense group is (split / tp + replicated) / (world / tp)."""
    d, d_kv, v = model.dim, model.n_kv_heads * model.dim // model.n_heads, 512  # vocab 500 pads to 512
    n_dense = model.first_k_dense if model.moe.n_experts else model.n_layers
    split = model.n_layers * (2 * d * d + 2 * d * d_kv) + n_dense * 3 * d * model.ffn_dim + 2 * v * d
    if model.qk_norm == "full":  # the q/k norm weights are split like the q/k columns
        split += model.n_layers * (d + d_kv)
    counts = count_params(Transformer(model, kernels="torch"), model)
    whole = make_plan(tp_cfg(model, 1), 4)
    halved = make_plan(tp_cfg(model, 2), 4)
    assert whole.params["per_device"] == counts.dense + counts.expert
    assert halved.params["per_device"] == counts.dense - split // 2 + counts.expert
    assert (halved.dp, halved.tp, halved.ep, halved.edp) == (2, 2, 1, 4)
    # bf16 parameters, two fp32 moments on the owned shard of 2 dense owners and 4 expert owners (+ padding)
    state = halved.state["ep_aware"]
    assert state["param_bytes"] == pytest.approx(2 * halved.params["per_device"], abs=2 * 4 * 128)
    owned = (counts.dense - split // 2) / 2 + counts.expert / 4
    assert state["optim_state_bytes"] == pytest.approx(8 * owned, abs=8 * 4 * 128)


@pytest.mark.parametrize("sp", [True, False])
def test_tensor_parallel_activation_bytes_by_hand(sp):
    """bf16, tp = 2, no QK-norm: the per-token terms of the module docstring on one tp rank. With sequence
    parallelism the norms keep t/tp tokens and attention, the dense FFN and the head each keep their
    all-gathered [t, D] input, and an MoE layer its (local) input; without it the norms keep all t tokens.
    Heads, FFN columns, vocabulary rows and an MoE layer's routed tokens are split in both. The attention
    module's gathered input is its checkpoint's input: recomputing attention keeps it; recomputing a whole
    dense block does not."""
    t, a, tp = 2 * 16, 2, 2
    d, d_kv, n, k, f, fs, e, ffn, v = 64, 32, 4, 2, 48, 48, 8, 96, 512
    model = ModelConfig(**{**SMALL.__dict__, "qk_norm": "none"})
    residual, gathered = (1 / tp, d * a) if sp else (1, 0)
    # both norms' input (optimus.model.norm recomputes the normalised rows); a norm's output is kept by the
    # projections it feeds, gathered with sp; an MoE layer keeps its 1/tp of the tokens as its input (the local
    # output with sp, else a copy of a slice)
    norm_output = 0 if sp else d * a
    norms = 2 * d * a * residual + norm_output
    attn = ((3 * d + 2 * d_kv) * a + 4 * n) / tp  # the region `selective` and `full` recompute
    dense = norms + gathered + attn + 4 * ffn * a / tp + gathered + norm_output
    routed = d * a + 4 * d + 8 * e + 28 * k + 2 * k * d * a + 4 * k * f * a + 4 * fs * a
    moe = norms + gathered + attn + routed / tp
    head = d * a * residual + norm_output + gathered + 4 * v / tp + 16  # the vocab-parallel loss's fp32 log-probs
    moe_regions = (attn, 4 * k * f * a / tp, 4 * fs * a / tp)  # recomputed one at a time under full
    moe_full = moe - sum(moe_regions)
    kept = {
        "none": dense + 2 * moe + head,
        "selective": dense - attn + 2 * (moe - attn) + head,
        "full": d * a * residual + 2 * moe_full + head,
    }
    for mode, per_token in kept.items():
        got = activation_bytes(model, 2, 16, a, mode, recompute=False, tp=tp, sp=sp)
        assert got == round(t * per_token), mode
    # full: block i's recomputation adds its largest region to what blocks 0..i keep, with the residual stream's
    # gradient (t/tp tokens with sp) and the region's input gradient ([t, D]) alive
    grads = d * a * (1 + residual)
    recomputed = [
        d * a * residual + dense + grads,
        *(d * a * residual + i * moe_full + max(moe_regions) + grads for i in (1, 2)),
    ]
    assert activation_bytes(model, 2, 16, a, "full", tp=tp, sp=sp) == round(t * max(kept["full"], *recomputed))


@pytest.mark.parametrize("qk_norm", ["head", "full"])
def test_tensor_parallel_qk_norm_activations(qk_norm):
    """q and k before QK-norm (its output is attention's q and k), split with the heads: D + D_kv values per token
    and layer over tp for a per-head norm; for the full-width norm the same and two fp32 inverse norms per token."""
    d, d_kv, a, t = 64, 32, 2, 2 * 16
    plain = ModelConfig(**{**SMALL.__dict__, "qk_norm": "none"})
    normed = ModelConfig(**{**SMALL.__dict__, "qk_norm": qk_norm})
    extra = [activation_bytes(m, 2, 16, a, "none", recompute=False, tp=2) for m in (normed, plain)]
    per_token = (d + d_kv) * a / 2 if qk_norm == "head" else (d + d_kv) * a / 2 + 8
    assert extra[0] - extra[1] == round(t * SMALL.n_layers * per_token)


def test_tensor_parallel_at_tp_1_changes_nothing():
    """tp = 1 is the plan without tensor parallelism, with or without sp (which matters only when tp > 1)."""
    for sp in (True, False):
        for mode in ("none", "selective", "full"):
            assert activation_bytes(SMALL, 2, 16, 2, mode, tp=1, sp=sp) == activation_bytes(SMALL, 2, 16, 2, mode)
    plain, with_sp_off = make_plan(tp_cfg(SMALL, 1), 4), make_plan(tp_cfg(SMALL, 1, sp=False), 4)
    assert plain.state == with_sp_off.state and plain.activations == with_sp_off.activations and not plain.sp


def test_pipeline_micro_batches_count_data_parallel_ranks_over_tp():
    """pp = 4 x tp = 2 on 8 ranks: one data-parallel rank per stage runs all 4 micro-batches of the step, so
    1F1B keeps 4, 3, 2, 1 in flight (counting 2 data-parallel ranks would give 2 micro-batches)."""
    cfg = tp_cfg(DENSE, 2, global_batch=4)
    cfg.model = ModelConfig(**{**DENSE.__dict__, "n_layers": 4})
    cfg.parallel.pp = 4
    plan = make_plan(cfg, 8)
    assert (plan.pp, plan.dp, plan.tp) == (4, 1, 2)
    assert [row["in_flight"] for row in plan.stages] == [4, 3, 2, 1]


FRONTIER = {  # experiment: (nodes, the study's parameter count, tp, pp)
    "frontier-22b": (16, 22e9, 2, 4),
    "frontier-175b": (128, 175e9, 4, 16),
    "frontier-1t": (384, 1e12, 8, 64),
}


@pytest.mark.parametrize("experiment", sorted(FRONTIER))
def test_frontier_study_experiments_fit_a_gcd(experiment):
    """The Frontier study's dense models on its layouts: the parameter count within 3% of the study's, TP inside
    a node, every pipeline rank fitting its 64 GB GCD as configured."""
    nodes, study_params, tp, pp = FRONTIER[experiment]
    cfg = load_config([f"experiment={experiment}"])
    plan = make_plan(cfg, nodes * cfg.machine.ranks_per_node)
    assert plan.params["total"] == pytest.approx(study_params, rel=0.03)
    assert (plan.tp, plan.pp, plan.sp, cfg.machine.ranks_per_node % tp) == (tp, pp, True, 0)
    assert plan.dp == nodes * cfg.machine.ranks_per_node // (tp * pp)
    assert all(row["fits"] for row in plan.stages) and plan.memory["fits_configured"]


@pytest.mark.parametrize("experiment", ["frontier-mula-20b-a2b", "frontier-mula-100b-a7b", "frontier-mula-220b-a10b"])
def test_frontier_moe_experiments_fit_a_gcd(experiment):
    """The Mula MoE models on 384 Frontier nodes: EP groups inside a node, every pipeline rank fitting its GCD;
    the MoE layers fold each stage's DP x TP ranks into EDP x EP (EDP = world / (pp x ep))."""
    cfg = load_config([f"experiment={experiment}"])
    plan = make_plan(cfg, 384 * 8)
    assert cfg.machine.ranks_per_node % plan.ep == 0 and plan.edp == 3072 // (plan.pp * plan.ep)
    assert plan.dp == 3072 // (plan.pp * plan.tp)
    assert all(row["fits"] for row in plan.stages) and plan.memory["fits_configured"]


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps from one forward of `model` and its loss, each storage counted
    once, parameters left out."""
    params = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = local_tensor(t)
        try:
            storage = local.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a collective's result still in flight: no storage to share yet
            key, size = id(t), local.numel() * local.element_size()
        if key not in params:
            kept[key] = size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:])
    return sum(kept.values())


def saved_activation_bytes(cfg: ModelConfig, sp: bool, batch: int, seq_len: int) -> dict[str, int]:
    """One tp rank (the world is the TP group): what autograd keeps for the backward, per checkpointing mode."""
    from optimus.parallel import build_parallel_state

    ps = build_parallel_state(1, tp=dist.get_world_size(), sp=sp)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("none", "selective", "full"):
        out[mode] = saved_bytes(rank_model(cfg, ps, seed=0, activation_checkpointing=mode), tokens)
    return out


TP_MODELS = {
    "dense": ModelConfig(n_layers=3, dim=128, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=256, qk_norm="none",
                         moe=MoEConfig(n_experts=0)),
    "moe": ModelConfig(n_layers=3, dim=128, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=256, first_k_dense=1,
                       qk_norm="none", moe=MoEConfig(n_experts=8, top_k=2, expert_dim=96, n_shared_experts=1)),
    "dense, full QK-norm": ModelConfig(n_layers=3, dim=128, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=256,
                                       qk_norm="full", moe=MoEConfig(n_experts=0)),
}  # fmt: skip


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("model", sorted(TP_MODELS))
def test_tensor_parallel_plan_counts_what_autograd_keeps(model, sp):
    """tp = 2 on 2 gloo ranks, fp32: the planner's kept activations per mode (the vocabulary-parallel head,
    sequence parallelism on and off) against the tensors autograd saves on each rank, within 5%."""
    cfg, batch, seq_len = TP_MODELS[model], 4, 64
    measured = run_distributed(saved_activation_bytes, 2, cfg, sp, batch, seq_len)
    assert measured[0] == measured[1]
    for mode, kept in measured[0].items():
        planned = activation_bytes(cfg, batch, seq_len, 4, mode, recompute=False, tp=2, sp=sp)
        assert planned == pytest.approx(kept, rel=0.05), mode
