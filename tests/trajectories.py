"""Comparing a run's per-step records with a reference run's: the invariant every parallel layout is tested
against (docs/ARCHITECTURE.md), shared by the layout oracles.

Rounding differs between layouts, so two router scores within rounding of each other can choose differently on
another layout (a routing flip); from then on the trajectories legitimately part. `expert_tokens` (the tokens
per expert and MoE layer over the global batch) shows where: every key is compared strictly up to the first
step whose `expert_tokens` differ from the reference's, the loss and the held-out loss at every step."""

from __future__ import annotations

import json

import pytest

from optimus.cli import main

# What must match step by step within relative 1e-5 until routing first differs; the held-out loss within 1e-6.
TRAJECTORY_KEYS = ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "expert_load_imbalance")
# What must match within relative 1e-5 at every step, routing flips or not.
EVERY_STEP_KEYS = ("loss", "lm_loss")


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_records(records: list[dict]) -> list[dict]:
    """The records of optimizer steps, without the starting evaluation (step 0)."""
    return [r for r in records if r["step"] > 0]


def train_layouts(tmp_path, runs: dict[str, list[str]], args: list[str]) -> tuple[dict[str, list], dict[str, dict]]:
    """`optimus train` once per layout, with `args` and then the layout's own overrides, in run0, run1, ... under
    `tmp_path`; returns each layout's per-step records and its run_info.json. Every run counts the whole model's
    parameters, whatever slice of it a rank holds."""
    metrics, infos = {}, {}
    for i, (layout, extra) in enumerate(runs.items()):
        run_dir = tmp_path / f"run{i}"
        assert main(["train", *args, *extra, f"run.dir={run_dir}"]) == 0, layout
        metrics[layout] = read_metrics(run_dir)
        infos[layout] = json.loads((run_dir / "run_info.json").read_text())
        assert infos[layout]["params"] == next(iter(infos.values()))["params"], layout
    return metrics, infos


def first_routing_difference(run: list[dict], reference: list[dict]) -> int | None:
    """The first step whose `expert_tokens` differ from the reference's (a routing flip), or None."""
    for m, ref in zip(step_records(run), step_records(reference)):
        assert "expert_tokens" in m, f"step {m['step']} has no expert_tokens"
        if m["expert_tokens"] != ref["expert_tokens"]:
            return m["step"]
    return None


def assert_same_trajectory(run: list[dict], reference: list[dict], layout: str) -> dict[str, float | int | None]:
    """`run` follows `reference`: every key of every step until routing first differs, the loss at every step.
    Returns the largest relative loss and grad-norm differences over the strictly compared steps, and
    `routing_differs_at`, that first step (None: routing agreed throughout)."""
    assert [m["step"] for m in run] == [m["step"] for m in reference], layout
    flip = first_routing_difference(run, reference)
    where = f"{layout} (expert_tokens first differ at step {flip})" if flip else layout
    strict = [(m, ref) for m, ref in zip(run, reference) if flip is None or m["step"] < flip]
    for m, ref in zip(run, reference):
        keys = TRAJECTORY_KEYS if flip is None or m["step"] < flip else EVERY_STEP_KEYS
        for key in keys if "loss" in ref else ():  # step 0 holds the starting evaluation only
            assert m[key] == pytest.approx(ref[key], rel=1e-5), (
                f"{where}: step {m['step']} {key} {m[key]!r}, one process {ref[key]!r}"
            )
        assert ("val_loss" in m) == ("val_loss" in ref), where
        if "val_loss" in ref:  # the same held-out sequences, whatever the layout
            tolerance = 1e-6 if flip is None or m["step"] < flip else 1e-5
            assert m["val_loss"] == pytest.approx(ref["val_loss"], rel=tolerance), f"{where}: step {m['step']} val_loss"
    worst = {
        k: max((abs(m[k] - r[k]) / abs(r[k]) for m, r in strict if "loss" in r), default=0.0)
        for k in ("loss", "grad_norm")
    }
    return {**worst, "routing_differs_at": flip}
