"""A property-based layout fuzzer: random valid layouts must reproduce the single-process trajectory.

The property (docs/ARCHITECTURE.md, "The invariant every parallel feature is tested against"): in fp32, any
layout (DP, EP, PP and its schedule, TP with or without SP, dispatcher and its overlap chunks, optimizer
sharding and its shard groups (optim.shard_ranks), ZeRO stage, parameter-gather overlap, activation
checkpointing) gives the per-step loss and gradient norm trajectory of one process accumulating gradients over
the same micro-batches, within relative 1e-5 (with AdamW or Muon): every key strictly until the first step whose
`expert_tokens` differ (a routing flip), the loss at every step (tests/trajectories.py).

Each case draws a model and a micro-batch split (MODEL_SPACE: what the single-process reference shares) and a
layout (LAYOUT_SPACE: how the same computation is spread over ranks), keeps the draw only if Optimus's own
`validate` accepts it (so a refusal lifted later is covered from then on, with no rule copied here), runs it
with `optimus train` and compares it with the reference run in one process (one run per distinct reference
within a test session).

    OPTIMUS_FUZZ_CASES=40 python -m pytest -q tests/parallel/test_layout_fuzz.py -s   # more cases
    OPTIMUS_FUZZ_SEED=1234 python -m pytest -q tests/parallel/test_layout_fuzz.py -s  # replay a seed

The seed is drawn afresh for every session unless OPTIMUS_FUZZ_SEED sets it; case i of a seed is the same
whatever the number of cases (`OPTIMUS_FUZZ_CASES=4 ... -k case3` replays case 3 alone: the count must
exceed the case's number). Every case prints its seed and overrides, and a failing
case's message holds both and the `optimus train` overrides that reproduce it.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from optimus.config import ConfigError
from optimus.config_checks import validate
from optimus.recipes import load_config
from tests.conftest import TINY_MODEL
from tests.trajectories import assert_same_trajectory, step_records, train_layouts

CASES = int(os.environ.get("OPTIMUS_FUZZ_CASES", "4"))
SEED = int(os.environ.get("OPTIMUS_FUZZ_SEED") or random.SystemRandom().randrange(2**31))
STEPS = 4

# What every case and its reference share: the tiny model made smaller, fp32 with the torch kernels, a few
# steps of 16-token sequences, evaluations halfway and at the end over 6 sequences (not a multiple of most worlds'
# micro-batches: some ranks evaluate padding), the z-loss and the sigmoid router's bias updates large enough to
# matter, and lr 5e-3 (tests/parallel/test_tensor_parallel.py says why not 1e-2). AdamW's eps is 1e-6, not 1e-8:
# Adam's first updates are about lr x sign(gradient) for every element, so an element whose gradient is rounding
# noise around zero (sums that nearly cancel, which each layout adds in its own order) moves by +-lr on one layout
# and -+lr on another; with eps 1e-8 that lifted the next step's gradient norm 1.2e-5 apart in 1 case of 16 (seed
# 608657209 case 4, on the code before the restructure too), with 1e-6 it stays within 8e-7, and every gradient
# that matters (well above 1e-6) still moves the weights as it would with any eps.
BASE = [
    *TINY_MODEL,
    "model.dim=32",
    "model.moe.expert_dim=32",
    "model.moe.z_loss_coef=0.01",
    "model.moe.bias_update_rate=0.01",
    "train.dtype=fp32",
    "kernels=torch",
    "logging.progress=false",
    f"train.steps={STEPS}",
    f"train.eval_interval={STEPS // 2}",
    "train.seq_len=16",
    "train.eval_sequences=6",
    "optim.warmup_steps=1",
    "optim.lr=5e-3",
    "optim.eps=1e-6",
    "parallel.timeout_s=60",
    "optim.muon_ns_dtype=fp32",  # read only when a case draws optim.update=muon
]

# The model and the micro-batches: the single-process reference runs with these too.
MODEL_SPACE = {
    "model.n_layers": [2, 4],
    "model.first_k_dense": [0, 1],
    "model.moe.n_shared_experts": [0, 1],
    "model.qk_norm": ["full", "head", "none"],
    "model.moe.router": ["softmax", "sigmoid"],
    "model.tie_embeddings": [False, True],
    "train.global_batch": [8, 12],
    "train.micro_batch": [1, 2, 4],
    # a third of the cases: Muon, its Newton-Schulz in fp32 (optim.muon_ns_dtype; bf16 is held to torch.optim.Muon
    # in tests/optim/test_muon.py), so that layouts agree within fp32 rounding like AdamW's
    "optim.update": ["adamw", "adamw", "muon"],
}

# The layout: the reference runs in one process with none of these.
LAYOUT_SPACE = {
    "parallel.nproc": [1, 2, 3, 4, 4, 4],  # 4 thrice: the one world where pp, tp and ep all combine
    "parallel.pp": [1, 2],
    "parallel.pp_schedule": ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb"],
    "parallel.tp": [1, 2],
    "parallel.sp": [True, False],
    "parallel.ep": [1, 2, 4],
    "parallel.dispatcher": ["alltoall", "allgather"],
    "parallel.ep_overlap_chunks": [1, 2],
    "optim.sharding": ["none", "standard", "ep_aware"],
    "optim.shard_ranks": [None, None, 1, 2],  # hierarchical sharding half the time (null: over all of a group's ranks)
    "optim.zero": [1, 2],
    "optim.bucket_mb": [0.01, 32.0],  # 0.01: several buckets, so ZeRO-2 reduces during the backward
    "optim.overlap_param_gather": [False, True],
    "train.activation_checkpointing": ["none", "selective", "full"],
}

# Keys that change nothing unless another key has a given value, left out otherwise so that a case's overrides
# name only what it tests. (What is valid is never decided here: `validate` alone rejects draws.)
INERT_UNLESS = {
    "parallel.pp_schedule": lambda d: d["parallel.pp"] > 1,
    "parallel.sp": lambda d: d["parallel.tp"] > 1,
    "parallel.dispatcher": lambda d: d["parallel.ep"] > 1,
    "parallel.ep_overlap_chunks": lambda d: d["parallel.ep"] > 1,
}

# Keys whose value follows from another's: the interleaved schedules run 2 stages per rank.
DERIVED = {"parallel.pp_virtual": lambda d: 2 if d.get("parallel.pp_schedule", "").startswith("interleaved") else None}


def as_overrides(draw: dict) -> list[str]:
    """`key=value` overrides, booleans as Hydra spells them; None (a key's default, null) left out."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in draw.items() if v is not None]


def draw_layout(rng: random.Random) -> dict:
    draw = {key: rng.choice(values) for key, values in LAYOUT_SPACE.items()}
    draw = {key: value for key, value in draw.items() if INERT_UNLESS.get(key, lambda d: True)(draw)}
    derived = {key: rule(draw) for key, rule in DERIVED.items()}
    return {**draw, **{key: value for key, value in derived.items() if value is not None}}


def is_valid(overrides: list[str], world: int) -> bool:
    try:
        validate(load_config(overrides), world)
    except ConfigError:
        return False
    return True


def draw_case(case: int) -> tuple[list[str], list[str]]:
    """(model overrides, layout overrides) of case `case` of SEED: the first draw that `validate` accepts."""
    rng = random.Random(f"{SEED}:{case}")
    for _ in range(1000):
        model = as_overrides({key: rng.choice(values) for key, values in MODEL_SPACE.items()})
        layout = draw_layout(rng)
        if is_valid([*BASE, *model, *as_overrides(layout)], layout["parallel.nproc"]):
            return model, as_overrides(layout)
    raise AssertionError(f"OPTIMUS_FUZZ_SEED={SEED} case {case}: no valid draw in 1000 tries")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The single-process run of `args`, as (per-step records, run_info); each distinct one runs once per module."""
    cache: dict[tuple[str, ...], tuple[list[dict], dict]] = {}

    def run(args: list[str]) -> tuple[list[dict], dict]:
        if tuple(args) not in cache:
            metrics, infos = train_layouts(tmp_path_factory.mktemp("fuzz-reference"), {"nproc=1": []}, args)
            cache[tuple(args)] = (metrics["nproc=1"], infos["nproc=1"])
        return cache[tuple(args)]

    return run


def reproduction(case: int, args: list[str], layout: list[str]) -> str:
    return (
        f"OPTIMUS_FUZZ_SEED={SEED} OPTIMUS_FUZZ_CASES={case + 1} python -m pytest tests/parallel/test_layout_fuzz.py "
        f"-k case{case}; "
        f"layout run: optimus train {' '.join([*args, *layout])}; reference: optimus train {' '.join(args)} "
        "(data.path: a corpus written by tests.conftest.write_corpus)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", range(CASES), ids=lambda i: f"case{i}")
def test_random_layout_matches_single_process(case, reference_run, tmp_path, corpus_file, single_threaded):
    model, layout = draw_case(case)
    args = [*BASE, *model, "data=text", f"data.path={corpus_file}"]
    how, label = reproduction(case, args, layout), " ".join(layout)
    print(f"\nlayout fuzz seed {SEED} case {case}: {' '.join([*model, *layout])}")
    try:
        reference, reference_info = reference_run(args)
        moving = {round(m["loss"], 6) for m in step_records(reference)}
        assert len(moving) == STEPS, "the reference's loss does not move: the comparison would mean nothing"
        metrics, infos = train_layouts(tmp_path, {label: layout}, args)
        assert infos[label]["params"] == reference_info["params"], f"{label}: other parameter counts"
        worst = assert_same_trajectory(metrics[label], reference, label)
    except Exception as err:  # a failed run, a mismatch: say how to reproduce it
        raise AssertionError(f"{how}\n{type(err).__name__}: {err}") from None
    print(f"  matches; max relative differences: {json.dumps(worst)}")
