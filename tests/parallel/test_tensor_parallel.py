"""Tensor and sequence parallelism: rank layout, what cannot run, the model split over 2 ranks against one
process (loss and every gradient), the optimizer-state geometry, and the oracle through the real CLI.

The oracle (ARCHITECTURE.md's invariant): fp32, 8 steps, global batch 8 in micro-batches of 2; every
layout reproduces the single-process trajectory (per-step loss, LM loss, router losses, grad norm, expert
load, held-out loss) within relative 1e-5. The runs use lr 5e-3: at the pipeline tests' 1e-2 the
trajectory has one spiking step (grad norm 2.6 against 1.5) that magnifies reduction-order rounding
20-100 times in every layout, plain data parallelism included (2e-6 at nproc 2, 2.4e-5 at tp 2), which
would test that step's conditioning rather than the layout.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from optimus.cli import load_config, main
from optimus.config import ConfigError
from optimus.config_checks import validate
from optimus.layout import Layout
from optimus.optim.state_ranges import StateRange, copy_overlap, covered
from optimus.parallel.state import ParallelState, build_parallel_state
from tests.distributed import run_distributed
from tests.parallel.test_pipeline import COMMON
from tests.trajectories import assert_same_trajectory, read_metrics, step_records, train_layouts

STEPS = 8
ORACLE = [k for k in COMMON if not k.startswith("optim.lr=")] + ["optim.lr=5e-3"]


def test_tp_is_the_innermost_rank_dimension():
    """world 8 = pp 2 x dp 2 x tp 2, with MoE layers folding ep 2 over the same ranks."""
    layout = Layout(world=8, ep=2, pp=2, tp=2)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    ps = ParallelState(rank=6, layout=layout)
    assert (ps.pp_rank, ps.tp_rank, ps.dp_rank, ps.dp, ps.ep_rank, ps.edp) == (1, 0, 1, 2, 0, 2)
    stage = ps.stage()
    assert (stage.rank, stage.world_size, stage.tp, stage.dp_rank, stage.dp) == (2, 4, 2, 1, 2)
    assert ParallelState(layout=Layout(world=2, tp=2, sp=True)).residual_seq_len(16) == 8
    assert ParallelState(layout=Layout(world=2, tp=2, sp=False)).residual_seq_len(16) == 16


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.tp=3"], "parallel.tp=3 does not divide the world size 4"),
        (["parallel.tp=4"], "does not divide model.n_kv_heads=2"),
        (["parallel.tp=2", "train.seq_len=15"], "does not divide train.seq_len=15"),
        (["parallel.tp=2", "model.moe.n_experts=0", "model.ffn_dim=63"], "does not divide model.ffn_dim=63"),
        (["parallel.tp=2", "model.tie_embeddings=true"], "model.tie_embeddings=true does not combine"),
        (["parallel.tp=2", "model.moe.seq_aux_loss_coef=0.1"], "seq_aux_loss_coef > 0 does not combine"),
        (["parallel.tp=2", "train.global_batch=6"], "world size / parallel.tp = 2 x 2"),
        (["parallel.tp=0"], "parallel.tp=0 must be a positive"),
    ],
)
def test_tensor_parallel_layouts_that_cannot_run_are_config_errors(overrides, message):
    cfg = load_config([*COMMON, *overrides])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 4)


def test_tensor_parallel_needs_processes():
    with pytest.raises(ConfigError, match="parallel.tp=2 needs several processes"):
        build_parallel_state(1, tp=2)


# ---- optimizer-state geometry ------------------------------------------------------------------


def _runs(rng: torch.Generator, n: int, pieces: int) -> list[tuple[int, int]]:
    cuts = sorted(torch.randperm(n - 1, generator=rng)[: pieces - 1].add(1).tolist())
    bounds = [0, *cuts, n]
    return list(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("seed", range(6))
def test_state_runs_of_column_blocks_and_of_whole_rows_reassemble_each_other(seed):
    """A matrix's state saved as runs of column blocks (tp 2 or 4, any cut) is read back into runs of the
    whole matrix (tp 1) and into other column blocks, element for element."""
    rng = torch.Generator().manual_seed(seed)
    shape = (6, 8)
    full = torch.arange(48.0).view(shape)
    saved = []  # (StateRange, values) from a tp = 2 or 4 layout, each block cut into uneven runs
    tp = (2, 4)[seed % 2]
    for t in range(tp):
        cols = (t * 8 // tp, (t + 1) * 8 // tp)
        block = full[:, cols[0] : cols[1]].reshape(-1)
        for lo, hi in _runs(rng, block.numel(), 3):
            saved.append((StateRange(lo, hi, shape, cols), block[lo:hi].clone()))
    targets = [StateRange(lo, hi, shape) for lo, hi in _runs(rng, 48, 4)]  # tp = 1: runs of the whole
    targets += [StateRange(lo, hi, shape, (4, 8)) for lo, hi in _runs(rng, 24, 2)]  # tp = 2, second block
    for target in targets:
        values, n = torch.full((target.hi - target.lo,), -1.0), 0
        for source, data in saved:
            n += copy_overlap(values, target, data, source)
            assert covered(target, source) == copy_overlap(torch.empty_like(values), target, data, source)
        a, b = target.block
        expected = full[:, a:b].reshape(-1)[target.lo : target.hi]
        assert n == target.hi - target.lo and torch.equal(values, expected)


# ---- the model split over two ranks against one process -------------------------------------------


def _split_model_grads(sp: bool, qk_norm: str, dense_first: int):
    """Rank body: one forward/backward of a TP model and of the same model in one process; returns the worst
    differences of the per-token loss and of each parameter's gradient (its role's way of combining). Also
    checks that `optimus plan` counts as split exactly the parameters the TP plan splits."""
    from torch.distributed.tensor import DTensor

    from optimus.config import ModelConfig, MoEConfig
    from optimus.parallel.tensor_parallel import PARTIAL, tp_grad_roles
    from optimus.plan_shares import meta_model, tp_split_params
    from tests.builds import rank_model

    ps = build_parallel_state(1, 60, tp=2, sp=sp)
    moe = MoEConfig(n_experts=4, top_k=2, expert_dim=32, n_shared_experts=1, z_loss_coef=0.01)
    cfg = ModelConfig(
        n_layers=3, dim=32, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=64, first_k_dense=dense_first,
        qk_norm=qk_norm, moe=moe,
    )  # fmt: skip
    reference = rank_model(cfg, seed=3)
    model = rank_model(cfg, ps, seed=3)
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(1))
    loss, ref_loss = model(tokens[:, :-1], tokens[:, 1:]), reference(tokens[:, :-1], tokens[:, 1:])
    loss.mean().backward()
    ref_loss.mean().backward()
    roles, ref_params = tp_grad_roles(model), dict(reference.named_parameters())
    worst = {"loss": (loss - ref_loss).abs().max().item()}
    for name, param in model.named_parameters():
        if isinstance(param.grad, DTensor):  # split, or partial (a Partial placement): DTensor combines it
            grad = param.grad.full_tensor()
        else:
            grad = param.grad.clone()
            if roles.get(name) == PARTIAL or name not in roles:  # partial shares; the experts' token halves
                dist.all_reduce(grad)
        worst[name] = (grad - ref_params[name].grad).abs().max().item()
    split = sum(model.get_parameter(n).numel() for n, role in roles.items() if role == "split")  # whole sizes
    per_layer, embed, head = tp_split_params(meta_model(cfg))  # what `optimus plan` divides by tp
    assert split == sum(per_layer) + embed + head
    return worst, roles


@pytest.mark.parametrize(
    "sp, qk_norm, dense_first", [(True, "full", 1), (False, "full", 0), (True, "head", 1), (False, "none", 1)]
)
def test_split_model_matches_one_process(sp, qk_norm, dense_first):
    """Attention (GQA, each QK-norm), dense SwiGLU, embedding, vocab-parallel head, MoE with a shared expert:
    per-token losses and every gradient equal one process's."""
    (worst, roles), (worst1, _) = run_distributed(_split_model_grads, 2, sp, qk_norm, dense_first)
    assert worst == pytest.approx(worst1, abs=1e-6)  # both ranks agree
    assert max(worst.values()) < 2e-6, {k: v for k, v in worst.items() if v >= 2e-6}
    assert roles["layers.0.attn.wq.weight"] == "split" and roles["layers.2.ffn.router.gate.weight"] == "partial"
    assert roles["layers.0.attn_norm.weight"] == ("partial" if sp else "replicated")


# ---- the oracle ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_tensor_parallel_layouts_match_single_process(tmp_path, corpus_file, single_threaded):
    data = ["data=text", f"data.path={corpus_file}"]
    # tp 2 alone, with experts folded into ep 2 (each dispatcher), and with pp 2 (1F1B and interleaved);
    # sequence parallelism on and off; ZeRO-2, the standard scheme, full activation checkpointing and the
    # parameter all-gathers left to the next forward once each.
    runs = {
        "nproc=1": [],
        "tp=2 sp": ["parallel.nproc=2", "parallel.tp=2"],
        "tp=2 no sp, zero=2": ["parallel.nproc=2", "parallel.tp=2", "parallel.sp=false", "optim.zero=2",
                               "optim.bucket_mb=0.01"],
        "tp=2 ep=2 sp, full checkpointing, gathers behind the forward": [
            "parallel.nproc=4", "parallel.tp=2", "parallel.ep=2", "train.activation_checkpointing=full",
            "optim.overlap_param_gather=true",
        ],
        "tp=2 ep=2 no sp, allgather, standard": ["parallel.nproc=4", "parallel.tp=2", "parallel.ep=2",
                                                 "parallel.sp=false", "parallel.dispatcher=allgather",
                                                 "optim.sharding=standard"],
        "tp=2 pp=2 sp 1f1b": ["parallel.nproc=4", "parallel.tp=2", "parallel.pp=2"],
        "tp=2 pp=2 no sp interleaved": ["parallel.nproc=4", "parallel.tp=2", "parallel.pp=2", "parallel.sp=false",
                                        "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2"],
    }  # fmt: skip
    metrics, _ = train_layouts(tmp_path, runs, [*ORACLE, *data])
    reference = metrics.pop("nproc=1")
    assert len({round(m["loss"], 6) for m in step_records(reference)}) == STEPS  # the loss moves: it means something
    worst = {layout: assert_same_trajectory(run, reference, layout) for layout, run in metrics.items()}
    print("max relative differences per layout:", worst)


@pytest.mark.slow
def test_checkpoint_written_at_tp2_resumes_at_tp1_and_tp4(tmp_path, corpus_file, single_threaded):
    """Split weights (DTensors) and their optimizer state (runs of row and column blocks) reshard: a tp 2
    checkpoint continues the single-process trajectory at tp 1, at tp 4, and at tp 2 x ep 2 with ZeRO-2."""
    common = [k for k in ORACLE if not k.startswith(("train.steps=", "train.eval_interval="))]
    common += ["train.steps=4", "train.eval_interval=4", "model.n_kv_heads=4", "data=text", f"data.path={corpus_file}"]
    assert main(["train", *common, f"run.dir={tmp_path / 'ref'}"]) == 0
    tp2 = ["parallel.nproc=2", "parallel.tp=2", "checkpoint.interval=2"]
    assert main(["train", *common, *tp2, f"run.dir={tmp_path / 'tp2'}"]) == 0
    load = f"checkpoint.load={tmp_path / 'tp2' / 'checkpoints' / 'step_000002'}"
    layouts = {
        "tp1": [],
        "tp4": ["parallel.nproc=4", "parallel.tp=4"],
        "tp2 ep2 zero2": ["parallel.nproc=4", "parallel.tp=2", "parallel.ep=2", "optim.zero=2"],
    }
    reference = read_metrics(tmp_path / "ref")
    assert_same_trajectory(read_metrics(tmp_path / "tp2"), reference, "tp2")
    for i, (name, layout) in enumerate(layouts.items()):
        assert main(["train", *common, *layout, load, f"run.dir={tmp_path / f'resumed{i}'}"]) == 0, name
        assert_same_trajectory(read_metrics(tmp_path / f"resumed{i}"), reference[3:], name)  # steps 3-4


@pytest.mark.slow
def test_bf16_tensor_parallel_run_keeps_bf16_slices(tmp_path, corpus_file, single_threaded):
    """train.dtype=bf16 at tp 2 x ep 2: the parameters, split ones included, are bf16 (the optimizer keeps fp32
    master copies, which it does only for parameters below fp32) and the losses stay within bf16 rounding of
    one process's."""
    common = [k for k in ORACLE if not k.startswith(("train.steps=", "train.eval_interval=", "train.dtype="))]
    common += ["train.steps=2", "train.eval_interval=2", "train.dtype=bf16", "data=text", f"data.path={corpus_file}"]
    assert main(["train", *common, f"run.dir={tmp_path / 'ref'}"]) == 0
    layout = ["parallel.nproc=4", "parallel.tp=2", "parallel.ep=2"]
    assert main(["train", *common, *layout, f"run.dir={tmp_path / 'tp'}"]) == 0
    for run, ref in zip(step_records(read_metrics(tmp_path / "tp")), step_records(read_metrics(tmp_path / "ref"))):
        assert run["loss"] == pytest.approx(ref["loss"], rel=2e-2)
    info = json.loads((tmp_path / "tp" / "run_info.json").read_text())
    assert info["dtypes"]["param"] == "bf16"
    assert all(rank["master_bytes"] > 0 for rank in info["per_rank"])
