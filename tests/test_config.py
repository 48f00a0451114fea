"""Bad configuration stops before training with one sentence that names the key and the fix."""

import os
import signal
import subprocess
import sys

import pytest

from optimus.cli import load_config, main
from optimus.config import ConfigError
from optimus.config_checks import validate
from optimus.layout import Layout, experts_per_rank, micro_batches_per_rank
from tests.unchanged import unchanged

# The small run: four steps of the tiny model.
SMALL_RUN = ["model=tiny", "train.global_batch=8", "train.micro_batch=2", "logging.progress=false",
             "train.seq_len=64", "train.eval_sequences=4", "train.steps=4"]  # fmt: skip


def error_of(overrides, world_size=1) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config(overrides), world_size)
    message = str(info.value)
    assert "\n" not in message.strip()
    return message


def test_default_config_is_valid():
    cfg = load_config([])
    validate(cfg)
    assert cfg.model.name == "tiny" and cfg.data.name == "builtin" and cfg.model.moe.n_experts > 0


def test_unknown_recipe_lists_the_choices():
    message = error_of(["model=mula-9000"])
    assert "'mula-9000'" in message and "mula-7b-a1b" in message and "tiny" in message


def test_the_unknown_recipe_named_is_the_one_hydra_could_not_find():
    # The last of two overrides of a group is the one Hydra looks for: the error names it, not the first.
    message = error_of(["model=tiny", "model=nonexistent"])
    assert message.startswith("Unknown model recipe 'nonexistent'")


def test_unknown_key_is_named():
    message = error_of(["train.stepz=3"])
    assert "train.stepz" in message


def test_wrong_type_is_named():
    message = error_of(["train.steps=many"])
    assert "train.steps" in message


def test_top_k_larger_than_experts():
    message = error_of(["model.moe.top_k=9", "model.moe.n_experts=8"])
    assert "model.moe.top_k=9" in message and "n_experts=8" in message


def test_heads_must_divide_dim():
    message = error_of(["model.n_heads=7"])
    assert "model.n_heads=7" in message and "divide" in message


def test_micro_batch_must_divide_global_batch():
    message = error_of(["train.global_batch=10", "train.micro_batch=4"])
    assert "train.micro_batch=4" in message and "train.global_batch=10" in message


def test_batch_must_split_over_the_world():
    message = error_of(["train.global_batch=8", "train.micro_batch=4"], world_size=4)
    assert "micro_batch x world size = 4 x 4" in message and "parallel.tp" not in message  # tp=1: not a factor
    message = error_of(["train.global_batch=8", "train.micro_batch=4", "parallel.tp=2"], world_size=8)
    assert "micro_batch x world size / parallel.tp = 4 x 4" in message


def test_ep_must_divide_experts_and_world():
    assert "parallel.ep=3" in error_of(["parallel.ep=3", "train.global_batch=32", "train.micro_batch=4"], world_size=8)
    assert "model.moe.n_experts=8" in error_of(["parallel.ep=3", "train.global_batch=24", "train.micro_batch=4"], 6)


@pytest.mark.parametrize(
    "override",
    [
        "train.eval_interval=0",
        "train.eval_sequences=0",
        "train.log_interval=0",
        "train.max_skipped_steps=-1",
        "train.grad_clip=-1",
        "optim.lr=0",
        "optim.warmup_steps=-5",
        "optim.min_lr_ratio=1.5",
    ],
)
def test_intervals_and_rates_out_of_range_are_named(override):
    key, value = override.split("=")
    assert f"{key}={value}" in error_of([override])


@pytest.mark.parametrize(
    "override,valid_range",
    [
        # AdamW: each of these turns the weights into nan or inf at the first step, or trains in reverse.
        ("optim.beta2=1.0", "must lie in [0, 1)"),
        ("optim.beta1=1.5", "must lie in [0, 1)"),
        ("optim.beta1=-0.1", "must lie in [0, 1)"),
        ("optim.beta2=nan", "must lie in [0, 1)"),
        ("optim.eps=-1.0", "must be a positive, finite number"),
        ("optim.eps=0.0", "must be a positive, finite number"),
        ("optim.weight_decay=-5.0", "must be 0 (no weight decay) or a positive finite number"),
        ("optim.bucket_mb=0.0", "must be a positive, finite number"),
        ("optim.max_collective_numel=0", "must be a positive, finite number"),
        ("model.moe.bias_update_rate=-1.0", "must be 0 (no bias updates) or a positive finite number"),
        ("model.moe.z_loss_coef=nan", "must be 0 (off) or a positive finite number"),
        ("model.moe.aux_loss_coef=inf", "must be 0 (off) or a positive finite number"),
        ("model.moe.capacity_factor=nan", "must be a positive, finite number, or null for dropless routing"),
        ("model.init_std=-1.0", "must be a positive, finite number"),
        ("model.embed_init_std=0.0", "must be a positive, finite number"),
        ("parallel.timeout_s=0.0", "must be a positive, finite number"),
        ("train.grad_clip=nan", "must be 0 (no clipping) or a positive finite number"),
        ("train.seed=-1", "must be 0 or a positive whole number"),
        ("machine.memory_gb=0.0", "must be a positive, finite number, or null when unknown"),
        ("machine.peak_flops=-1.0", "must be a positive, finite number, or null to look it up or probe it"),
        ("machine.ranks_per_node=-2", "must be a positive, finite number, or null for local runs"),
        ("data.vocab_size=0", "must be a positive, finite number"),
        ("data.max_chars=0", "must be a positive, finite number"),
        ("data.prefetch=-1", "must be 0 (no background loading) or a positive whole number"),
    ],
)
def test_hyper_parameters_out_of_range_are_refused_with_the_range(override, valid_range):
    message = error_of([override])
    assert message.startswith(f"{override} {valid_range}") and message.endswith(".")


def test_bucket_size_is_refused_under_zero_2_too():
    assert "optim.bucket_mb=0.0 must be a positive" in error_of(["optim.bucket_mb=0", "optim.zero=2"])


def test_weight_decay_that_would_flip_the_weights_is_refused():
    message = error_of(["optim.lr=0.01", "optim.weight_decay=100"])
    assert message.startswith("optim.lr x optim.weight_decay = 0.01 x 100.0 must be below 1")


@pytest.mark.parametrize("override", ["optim.beta1=0", "optim.beta2=0.999", "optim.weight_decay=0", "train.grad_clip=0",
                                      "model.moe.bias_update_rate=0", "data.prefetch=0", "train.seed=0"])  # fmt: skip
def test_the_ends_of_the_ranges_are_accepted(override):
    validate(load_config([override]))


def test_bad_choice_lists_the_options():
    assert "auto, fp32, bf16" in error_of(["train.dtype=fp8"])


def test_layout_rules_are_one_class():
    # Layout refuses what does not divide, for config_checks.validate and parallel.state.build_parallel_state alike.
    Layout(world=12, ep=3, pp=2)  # 2 stages of 6 ranks, EP groups of 3
    with pytest.raises(ConfigError, match="parallel.pp=5 does not divide the world size 12"):
        Layout(world=12, pp=5)
    with pytest.raises(ConfigError, match="parallel.ep=4 does not divide the 6 ranks of a pipeline stage"):
        Layout(world=12, ep=4, pp=2)
    with pytest.raises(ConfigError, match="parallel.ep=4 does not divide the world size 6"):
        Layout(world=6, ep=4)
    with pytest.raises(ConfigError, match="parallel.tp=0 must be a positive"):
        Layout(world=6, tp=0)


def test_shard_ranks_must_cut_the_optimizer_groups_and_need_a_sharded_scheme():
    batch = ["train.global_batch=48", "train.micro_batch=1"]
    validate(load_config([*batch, "optim.shard_ranks=2", "parallel.ep=2"]), 8)  # dp 8, edp 4: groups of 2
    message = error_of([*batch, "optim.shard_ranks=4"], 6)
    assert message.startswith("optim.shard_ranks=4 does not divide the 6 data-parallel and 6 expert-data-parallel")
    message = error_of([*batch, "optim.shard_ranks=4", "parallel.tp=2", "parallel.ep=4"], 8)  # dp 4, edp 2
    assert message.endswith("choose a shard_ranks that divides 2, or null.")
    assert "must be a positive whole number" in error_of([*batch, "optim.shard_ranks=0"], 4)
    for sharding, world in (("none", 4), ("auto", 1)):
        message = error_of([*batch, "optim.shard_ranks=1", f"optim.sharding={sharding}"], world)
        assert f"optim.shard_ranks=1 needs a sharded optimizer, which optim.sharding={sharding} on {world}" in message
        assert message.endswith("set optim.shard_ranks=null, or optim.sharding=ep_aware or standard.")


def test_experts_per_rank():
    assert [experts_per_rank(8, ep) for ep in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert experts_per_rank(0, 1) == 0  # a dense model without expert parallelism
    with pytest.raises(ConfigError, match="needs a model with experts"):
        experts_per_rank(0, 2)
    with pytest.raises(ConfigError, match="model.moe.n_experts=8 is not divisible by parallel.ep=3"):
        experts_per_rank(8, 3)


def test_micro_batches_per_rank():
    assert micro_batches_per_rank(32, 4, 2) == 32 // (4 * 2)
    with pytest.raises(ConfigError, match="train.micro_batch x ranks per pipeline stage = 4 x 3"):
        micro_batches_per_rank(32, 4, 3, "ranks per pipeline stage")
    with pytest.raises(ConfigError, match="train.micro_batch=0"):
        micro_batches_per_rank(32, 0, 1)


def test_the_config_accepts_exactly_the_dispatchers_that_exist():
    # parallel.dispatcher's values are the names of the implemented dispatchers, listed once.
    for name in ("alltoall", "allgather"):
        validate(load_config([f"parallel.dispatcher={name}"]))
    with pytest.raises(ConfigError, match=r"parallel.dispatcher='ring' is not supported: .* alltoall, allgather\."):
        validate(load_config(["parallel.dispatcher=ring"]))


def test_cli_prints_one_line_and_exits_2(capsys):
    assert main(["train", "model.moe.top_k=99"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optimus: error: model.moe.top_k=99") and "\n" not in err


def test_cli_help(capsys):
    assert main(["--help"]) == 0
    assert "train" in capsys.readouterr().out
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "mula-7b-a1b" in out and "parallel.ep" in out


@pytest.mark.parametrize(
    "overrides, words",
    [
        # pp = 1: the stage keys would be ignored, and pp_virtual made one process raise from torch and two hang.
        (["parallel.pp_virtual=2"], "parallel.pp_virtual=2 needs pipeline stages, but parallel.pp=1"),
        (["parallel.pp_schedule=interleaved_1f1b"], "parallel.pp_schedule=interleaved_1f1b needs pipeline stages"),
        (["parallel.pp_schedule=gpipe"], "set parallel.pp to 2 or more, or parallel.pp_schedule=1f1b"),
        (["parallel.pp_layers=[1,3]"], "or parallel.pp_layers=null"),
        # A trace window after the last step wrote no trace; a mixture was read only by data=tokens.
        (
            ["profile.torch=true", "profile.torch_steps=10-20"],
            "profile.torch_steps=10-20 ends after the run's train.steps=4",
        ),
        (
            ["profile.operators=true", "profile.torch_steps=10-20"],
            "profile.torch_steps=10-20 ends after the run's train.steps=4",
        ),
        (["data.mix=[{path: shards, weight: 1}]"], "data.mix is read only with data=tokens, not data=builtin"),
    ],
)
def test_keys_a_run_would_ignore_or_hang_on_are_refused_before_anything_is_written(tmp_path, capsys, overrides, words):
    with unchanged(tmp_path):
        assert main(["train", *SMALL_RUN, *overrides, f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_stages_per_rank_without_pipeline_stages_is_refused_before_ranks_start(tmp_path):
    # Two processes used to start and wait for pipeline peers forever: in a session of its own, so that a
    # regression ends as a failure (the whole group killed) rather than a hung test.
    args = [
        "train",
        *SMALL_RUN,
        "parallel.nproc=2",
        "parallel.ep=2",
        "parallel.pp_virtual=2",
        f"run.dir={tmp_path / 'run'}",
    ]
    with unchanged(tmp_path):
        child = subprocess.Popen(
            [sys.executable, "-m", "optimus", *args], stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            _, err = child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    assert child.returncode == 2 and err.strip() == (
        "optimus: error: parallel.pp_virtual=2 needs pipeline stages, but parallel.pp=1: set parallel.pp to 2 or "
        "more, or parallel.pp_virtual=1."
    )
