"""Pipeline parallelism: stage cutting, and the oracle through the real CLI (4 processes, fp32).

Every pipeline layout must reproduce the single-process trajectory (per-step loss, LM loss,
router losses, grad norm, expert load, held-out loss) within relative 1e-5, as every other
layout does (ARCHITECTURE.md's invariant).
"""

from __future__ import annotations

import itertools
import random

import pytest

from optimus.cli import load_config, main
from optimus.config import ConfigError
from optimus.config_checks import validate
from optimus.layout import Layout
from optimus.model import padded_vocab_size
from optimus.parallel.pipeline import balanced_split, rank_stage_indices, stage_costs, stage_layer_ids, stage_sizes
from optimus.parallel.state import ParallelState
from tests.conftest import TINY_MODEL
from tests.trajectories import assert_same_trajectory, read_metrics, step_records, train_layouts

STEPS = 8
COMMON = [
    *TINY_MODEL,
    "model.n_layers=4",
    "model.dim=32",
    "model.moe.expert_dim=32",
    "model.moe.n_shared_experts=1",
    "model.moe.z_loss_coef=0.01",
    "train.dtype=fp32",
    "kernels=torch",
    "logging.progress=false",
    f"train.steps={STEPS}",
    f"train.eval_interval={STEPS // 2}",
    "train.seq_len=16",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.eval_sequences=6",
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    "optim.zero=1",
    "parallel.timeout_s=60",
]


def test_stages_cut_layers_evenly_and_loop_over_ranks():
    assert balanced_split([1] * 4, 2) == [2, 2]
    assert balanced_split([1] * 7, 3) == [3, 2, 2]  # ties: the larger stages first
    assert stage_layer_ids([3, 2, 2]) == [[0, 1, 2], [3, 4], [5, 6]]
    assert rank_stage_indices(1, pp=2, pp_virtual=2) == [1, 3]
    with pytest.raises(ConfigError, match="cannot fill 4 pipeline stages"):
        balanced_split([1] * 3, 4)


def brute_force_split(costs: list[int], n_stages: int, first: int, last: int) -> int:
    """The smallest costliest stage over every way to cut `costs` into `n_stages` consecutive runs."""
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), n_stages - 1):
        bounds = [0, *cuts, len(costs)]
        stage_costs = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stage_costs[0] += first
        stage_costs[-1] += last
        best = max(stage_costs) if best is None else min(best, max(stage_costs))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_split_minimises_the_costliest_stage(seed):
    """The embedding and head weigh on the first and last stages; no other cut has a cheaper costliest stage."""
    rng = random.Random(seed)
    costs = [rng.randint(1, 9) for _ in range(rng.randint(4, 10))]
    n_stages, first, last = rng.randint(2, 4), rng.randint(0, 12), rng.randint(0, 12)
    sizes = balanced_split(costs, n_stages, first, last)
    assert len(sizes) == n_stages and sum(sizes) == len(costs) and min(sizes) >= 1
    bounds = [0, *itertools.accumulate(sizes)]
    got = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    got[0] += first
    got[-1] += last
    assert max(got) == brute_force_split(costs, n_stages, first, last)


def test_embedding_and_head_count_in_the_automatic_split():
    """With a vocabulary as heavy as several layers, the end stages take fewer layers; pp_layers overrides."""
    cfg = load_config([*COMMON, "model.n_layers=8", "model.vocab_size=4096"]).model
    layers, embed, head = stage_costs(cfg)
    assert embed == cfg.dim * padded_vocab_size(cfg.vocab_size) and embed > 2 * layers[0]
    sizes = stage_sizes(cfg, 4)
    assert sum(sizes) == 8 and sizes[0] < sizes[1] and sizes[-1] < sizes[-2]
    assert stage_sizes(cfg, 2, [5, 3]) == [5, 3]


def test_pp_is_the_outermost_rank_dimension():
    """world 8 = pp 2 x dp 2 x ep 2: a stage is a run of 4 ranks, EDP groups stay inside their stage."""
    layout = Layout(world=8, ep=2, pp=2)
    assert layout.stage_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.edp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    ps = ParallelState(rank=6, layout=layout)
    assert (ps.pp_rank, ps.stage_size, ps.edp, ps.edp_rank, ps.ep_rank) == (1, 4, 2, 1, 0)
    stage = ps.stage()  # the stage as a world of its own, for the optimizer and the data loader
    assert (stage.rank, stage.world_size, stage.pp, stage.edp, stage.edp_rank, stage.ep_rank) == (2, 4, 1, 2, 1, 0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], "needs parallel.pp_virtual >= 2"),
        (["parallel.pp=2", "parallel.pp_virtual=2"], "needs parallel.pp_schedule=interleaved_1f1b or interleaved_zb"),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_zb"], "needs parallel.pp_virtual >= 2"),
        (["parallel.pp=3"], "does not divide the world size 4"),
        (["parallel.pp=2", "parallel.pp_layers=[1,2]"], "add up to model.n_layers=4"),
        (["parallel.pp=2", "parallel.pp_layers=[4]"], "must list 2 positive layer counts"),
        (["parallel.pp=2", "parallel.pp_layers=[0,4]"], "must list 2 positive layer counts"),
        (["parallel.pp=4", "train.global_batch=4"], "needs a multiple of parallel.pp=4 micro-batches"),
        (["parallel.pp=2", "parallel.pp_schedule=zero"], "parallel.pp_schedule='zero' is not supported"),
    ],
)
def test_pipeline_layouts_that_cannot_run_are_config_errors(overrides, message):
    cfg = load_config([*COMMON, *overrides])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 4)


@pytest.mark.slow
def test_pipeline_layouts_match_single_process(tmp_path, corpus_file, single_threaded):
    data = ["data=text", f"data.path={corpus_file}"]
    # 1F1B with an uneven stage split given by the recipe, the all-gather dispatcher and activation
    # checkpointing; interleaved and zero bubble with ZeRO-2, whose reduction must wait for each of a
    # rank's two stages' last backward (zero bubble: its last weight backward, which comes after the
    # input backward), interleaved with the parameter all-gathers left to each stage's forward; GPipe
    # with the per-stage timers on.
    runs = {
        "nproc=1": [],
        "pp=2 ep=2 1f1b layers 1+3, allgather, selective checkpointing": [
            "parallel.nproc=4", "parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=1f1b",
            "parallel.pp_layers=[1,3]", "parallel.dispatcher=allgather", "train.activation_checkpointing=selective",
        ],
        "pp=2 ep=2 interleaved v=2 zero=2, gathers behind the forward": [
            "parallel.nproc=4", "parallel.pp=2", "parallel.ep=2",
            "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2", "optim.zero=2", "optim.bucket_mb=0.01",
            "optim.overlap_param_gather=true",
        ],
        "pp=2 ep=2 zero bubble v=2 zero=2": [
            "parallel.nproc=4", "parallel.pp=2", "parallel.ep=2",
            "parallel.pp_schedule=interleaved_zb", "parallel.pp_virtual=2", "optim.zero=2", "optim.bucket_mb=0.01",
        ],
        "pp=4 gpipe": ["parallel.nproc=4", "parallel.pp=4", "parallel.pp_schedule=gpipe", "profile.timers=true"],
    }  # fmt: skip
    metrics, _ = train_layouts(tmp_path, runs, [*COMMON, *data])

    reference = metrics.pop("nproc=1")
    assert len({round(m["loss"], 6) for m in step_records(reference)}) == STEPS  # the loss moves: it means something
    worst = {}
    for layout, run in metrics.items():
        worst[layout] = assert_same_trajectory(run, reference, layout)
        if "profile.timers=true" in runs[layout]:  # every stage's forward + backward time, from every stage
            assert all(len(m["stage_time_s"]) == 4 and min(m["stage_time_s"]) > 0 for m in step_records(run)), layout
    print("max relative differences per layout:", worst)


@pytest.mark.slow
def test_tied_embeddings_across_stages_match_single_process(tmp_path, corpus_file, single_threaded):
    """tie_embeddings with the embedding on the first stage and the head on the last: the pp=2 trajectory equals
    the single-process one with ZeRO-1 and with ZeRO-2 (whose reduction of the embedding waits for the head's
    gradient), and the ZeRO-1 run's step-2 checkpoint continues it in one process (steps 3-4)."""
    common = [k for k in COMMON if not k.startswith(("train.steps=", "train.eval_interval="))]
    common += ["model.tie_embeddings=true", "train.steps=4", "train.eval_interval=4", "data=text"]
    common += [f"data.path={corpus_file}"]
    layout = ["parallel.nproc=4", "parallel.pp=2", "parallel.ep=2"]
    layout += ["optim.overlap_param_gather=true"]  # the tied copy and the checkpoint wait for the gathers
    assert main(["train", *common, f"run.dir={tmp_path / 'ref'}"]) == 0
    assert main(["train", *common, *layout, "checkpoint.interval=2", f"run.dir={tmp_path / 'pp'}"]) == 0
    zero2 = ["optim.zero=2", "optim.bucket_mb=0.01"]
    assert main(["train", *common, *layout, *zero2, f"run.dir={tmp_path / 'pp_zero2'}"]) == 0
    load = f"checkpoint.load={tmp_path / 'pp' / 'checkpoints' / 'step_000002'}"
    assert main(["train", *common, load, f"run.dir={tmp_path / 'resumed'}"]) == 0
    reference = step_records(read_metrics(tmp_path / "ref"))
    for run_dir, steps in (("pp", [1, 2, 3, 4]), ("pp_zero2", [1, 2, 3, 4]), ("resumed", [3, 4])):
        run = step_records(read_metrics(tmp_path / run_dir))
        assert [m["step"] for m in run] == steps, run_dir
        for m in run:
            ref = reference[m["step"] - 1]
            for key in ("loss", "grad_norm"):
                assert m[key] == pytest.approx(ref[key], rel=1e-5), f"{run_dir}: step {m['step']} {key}"
        assert run[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], rel=1e-6), run_dir


# The Mula recipes' own model files (all-MoE layers, softmax routing, full QK-norm, z-loss) with small
# dimensions; 12 experts so that EP 2 and the recipes' EP 12 both divide them; AdamW, as their experiments train.
SCALED_DOWN = [
    "optim.update=adamw",
    "model.dim=32", "model.n_heads=4", "model.n_kv_heads=4", "model.vocab_size=512", "data.vocab_size=512",
    "model.ffn_dim=64", "model.moe.n_experts=12", "model.moe.top_k=2", "model.moe.expert_dim=16",
    "train.dtype=fp32", "kernels=torch", "logging.progress=false", "train.steps=4", "train.eval_interval=4",
    "train.seq_len=16", "train.global_batch=8", "train.micro_batch=2", "train.eval_sequences=4",
    "optim.warmup_steps=1", "optim.lr=1e-2", "parallel.timeout_s=60",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,layout",
    [
        # Aurora: PP 4 x EP 12, 1F1B; here PP 2 x EP 2 over 8 of its 48 layers
        ("mula-100b-a7b", ["model.n_layers=8", "parallel.pp=2", "parallel.ep=2", "optim.zero=2"]),
        # Aurora: PP 8 x EP 12, 1F1B; here PP 4 (four processes leave no room for EP) over 8 of its 64 layers
        ("mula-220b-a10b", ["model.n_layers=8", "parallel.pp=4"]),
    ],
    ids=["100b-pp2-ep2", "220b-pp4"],
)
def test_scaled_down_mula_recipes_train_at_their_pipeline_layout(model, layout, tmp_path, corpus_file, single_threaded):
    common = [f"model={model}", *SCALED_DOWN, "data=text", f"data.path={corpus_file}", "model.n_layers=8"]
    assert main(["train", *common, f"run.dir={tmp_path / 'ref'}"]) == 0
    assert main(["train", *common, *layout, "parallel.nproc=4", f"run.dir={tmp_path / 'pp'}"]) == 0
    reference, run = step_records(read_metrics(tmp_path / "ref")), step_records(read_metrics(tmp_path / "pp"))
    assert [m["step"] for m in run] == [1, 2, 3, 4]
    assert reference[-1]["loss"] < reference[0]["loss"]  # it trains
    for m, ref in zip(run, reference):
        for key in ("loss", "z_loss", "grad_norm", "expert_load_imbalance"):
            assert m[key] == pytest.approx(ref[key], rel=1e-5), f"{model}: step {m['step']} {key}"
    assert run[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], rel=1e-6)


def unpacked_at_step(overrides: list[str], cache: str) -> tuple[int, int]:
    """One rank: one training step; (ZeRO-2 gradient slots the backward left for step() to pack, all slots)."""
    import os

    from optimus.optim import shard_group
    from optimus.train.trainer import Trainer

    os.environ["OPTIMUS_CACHE"] = cache  # forked ranks share the test session's tokenizer cache
    trainer = Trainer.from_config(load_config(overrides))
    left, reduce_rest = [], shard_group.ShardGroup.reduce_rest

    def counted(group):
        left.append(sum(not packed for packed in group.packed))
        reduce_rest(group)

    shard_group.ShardGroup.reduce_rest = counted
    try:
        trainer.train_step()
    finally:
        shard_group.ShardGroup.reduce_rest = reduce_rest
        trainer.loader.close()
    return sum(left), sum(len(g.flat.slots) for g in trainer.optimizer.sharder.groups.values())


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "interleaved_zb"])
def test_zero2_reduces_each_stage_during_its_backward(tmp_path, corpus_file, schedule):
    """Zero bubble's weight pass assigns .grad without autograd's accumulation and its hooks; the optimizer's
    tensor hooks still see each gradient arrive and count them, so ZeRO-2 packs and reduces the step's last ones
    during the backward, as with the other schedules, instead of holding the whole gradient until step()."""
    import os

    from tests.distributed import run_distributed

    overrides = [
        *COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={tmp_path / 'run'}", "parallel.nproc=2",
        "parallel.pp=2", f"parallel.pp_schedule={schedule}", "parallel.pp_virtual=2", "optim.zero=2",
        "optim.bucket_mb=0.01",
    ]  # fmt: skip
    for left, slots in run_distributed(unpacked_at_step, 2, overrides, os.environ["OPTIMUS_CACHE"]):
        assert slots > 0 and left == 0, (schedule, left, slots)


# A pp=2 x ep=2 layout whose stage inputs are large beside its weights, so that one buffer per micro-batch shows.
PIPELINE_MEMORY = [
    *TINY_MODEL, "model.n_layers=4", "model.dim=256", "model.ffn_dim=512", "model.moe.expert_dim=128",
    "train.steps=1", "train.micro_batch=2", "train.seq_len=128", "train.dtype=bf16", "parallel.nproc=4",
    "parallel.pp=2", "parallel.ep=2",
]  # fmt: skip


@pytest.mark.slow
def test_a_stages_memory_does_not_grow_with_the_micro_batches_of_a_step():
    """torch's PipelineStage made a receive buffer per micro-batch of the step as a schedule first ran, all alive
    at once, and kept them for the whole run; the last stage kept every micro-batch's input (through the loss the
    schedule keeps, and a tracker's hooks). Optimus's stages (optimus.parallel.pipeline_stage) make and keep what
    the micro-batches in flight need. A dry run of the first and the last stage on the GPU's path, with 4 and 32
    micro-batches per rank: the peak grows by no more than the step's token ids (the loader's micro-batches and
    their concatenation, [micro_batch, seq_len + 1] int64 each), and is within 5% of the plan, which counts no
    buffer per micro-batch. A buffer per micro-batch would add 28 of [2, 128, 256] bf16 (3.5 MiB) to the 8 KiB
    per micro-batch allowed (with torch's stage the first stage grew 26% from 8 to 128 micro-batches)."""
    from optimus.dry_run import dry_run_rank

    def token_bytes(accum: int) -> int:
        return 2 * accum * 2 * 129 * 8  # (micro_batch 2, seq_len 128: PIPELINE_MEMORY)

    for rank in (0, 2):  # the first stage receives gradients, the last inputs
        memory, accum = {}, {}
        for batch in (16, 128):
            cfg = load_config([*PIPELINE_MEMORY, f"train.global_batch={batch}"])
            result = dry_run_rank(cfg, 4, rank, device="cuda")
            memory[batch], accum[batch] = result["memory"], result["layout"]["accum"]
        grown = memory[128]["peak_bytes"] - memory[16]["peak_bytes"]
        assert (accum[16], accum[128]) == (4, 32)
        assert grown <= token_bytes(32) - token_bytes(4) + 64 * 1024, (rank, grown, memory)
        # (the plan leaves the token ids out: KiBs per micro-batch)
        assert abs(memory[16]["peak_bytes"] / memory[16]["planned_bytes"] - 1) < 0.05, (rank, memory[16])
