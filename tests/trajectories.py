"""Comparing a run's per-step records with a reference run's: the invariant every parallel layout is tested
against (docs/ARCHITECTURE.md), shared by the layout oracles."""

from __future__ import annotations

import json

import pytest

from optimus.cli import main

# What must match step by step within relative 1e-5; the held-out loss within 1e-6.
TRAJECTORY_KEYS = ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "expert_load_imbalance")


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


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


def assert_same_trajectory(run: list[dict], reference: list[dict], layout: str) -> dict[str, float]:
    """Every step of `run` equals `reference`'s; returns the largest relative loss and grad-norm differences."""
    assert [m["step"] for m in run] == [m["step"] for m in reference], layout
    for m, ref in zip(run, reference):
        for key in TRAJECTORY_KEYS:
            assert m[key] == pytest.approx(ref[key], rel=1e-5), f"{layout}: step {m['step']} {key}"
        assert ("val_loss" in m) == ("val_loss" in ref), layout
        if "val_loss" in ref:  # the same held-out sequences, whatever the layout
            assert m["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6), f"{layout}: val_loss"
    return {k: max(abs(m[k] - r[k]) / abs(r[k]) for m, r in zip(run, reference)) for k in ("loss", "grad_norm")}
