"""The held-out loss is a property of the model, not of the layout: the same sequences for any micro-batch.

(The multi-process layouts are checked on the same held-out set in test_expert_parallel_training.py.)
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from optimus.cli import load_config
from optimus.train.trainer import Trainer
from tests.conftest import TINY_MODEL

RUN = [
    *TINY_MODEL, "data=text", "train.seq_len=32", "train.global_batch=8", "train.dtype=fp32", "kernels=torch",
    "train.eval_sequences=7", "machine.peak_flops=1e12", "logging.progress=false",
]  # fmt: skip


def trainer(tmp_path, corpus_file, micro_batch: int) -> Trainer:
    return Trainer.from_config(load_config([*RUN, f"data.path={corpus_file}", f"train.micro_batch={micro_batch}",
                                f"run.dir={tmp_path / f'mb{micro_batch}'}"]))  # fmt: skip


def test_val_loss_does_not_depend_on_the_micro_batch(tmp_path, corpus_file):
    """7 sequences in micro-batches of 1, 2, 4 and 8 (padded): the same mean token loss, equal to a plain loop."""
    losses = {}
    for micro_batch in (1, 2, 4, 8):
        t = trainer(tmp_path, corpus_file, micro_batch)
        try:
            losses[micro_batch] = t.evaluate()
        finally:
            t.loader.close()
    # Reference: the same model, one sequence at a time, mean over every predicted token.
    t.model.eval()
    rows = [b[w.bool()] for b, w in t.eval_batches]
    with torch.no_grad():
        per_seq = [
            F.cross_entropy(t.model(r[None, :-1])[0].float(), r[1:], reduction="sum").item() for r in torch.cat(rows)
        ]
    expected = math.fsum(per_seq) / (len(per_seq) * 32)
    assert len(per_seq) == 7
    for micro_batch, loss in losses.items():
        assert loss == pytest.approx(expected, rel=1e-6), micro_batch


def test_more_eval_sequences_than_held_out_windows_says_how_many_were_used(tmp_path, corpus_file, capsys):
    """train.eval_sequences is an upper bound (its default, 32, is more than a small corpus holds out): a run
    says in one line how many held-out windows it evaluates on, and records the number beside every val_loss."""
    from optimus.cli import main
    from optimus.data import build_data

    run_dir = tmp_path / "run"
    args = [*RUN, f"data.path={corpus_file}", "train.micro_batch=4", "train.steps=1", f"run.dir={run_dir}"]
    assert main(["train", *args, "train.eval_sequences=1000000"]) == 0
    cfg = load_config(args)
    held_out = len(build_data(cfg.data, cfg.train.seq_len, cfg.train.seed).val)
    assert held_out < 1000000
    out = capsys.readouterr().out
    assert (
        f"train.eval_sequences=1000000, but the held-out set has {held_out} windows of train.seq_len + 1 tokens: "
        f"every evaluation uses those {held_out}"
    ) in out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["val_sequences"]) for r in records if "val_loss" in r] == [(0, held_out), (1, held_out)]
