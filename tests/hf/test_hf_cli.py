"""`optimus checkpoint import` -> continued pretraining with the printed command -> `export --format hf`:
the exported directory gives transformers the trained model's logits."""

from __future__ import annotations

import shlex
import warnings

import pytest
import torch

from optimus.cli import load_config, main
from optimus.hf import from_pretrained
from optimus.train.trainer import Trainer
from tests.hf.test_hf import CASES, random_hf_model, relative_error

transformers = pytest.importorskip("transformers")

TRAIN = [
    "train.dtype=fp32", "kernels=torch", "logging.progress=false", "train.steps=2", "train.seq_len=16",
    "train.global_batch=2", "train.micro_batch=2", "train.eval_interval=2", "train.eval_sequences=2",
    "optim.warmup_steps=1", "checkpoint.interval=2",
]  # fmt: skip


def run_without_user_warnings(argv: list[str]) -> int:
    """`optimus ARGV`'s exit code; fails if a UserWarning would reach the user's output (DCP's included)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(argv)
    assert not [w for w in caught if issubclass(w.category, UserWarning)], [str(w.message) for w in caught]
    return code


def test_import_continue_pretraining_and_export(tmp_path, corpus_file, capsys):
    fmt, shape = CASES["olmoe-gqa-top8"]
    shape = {**shape, "vocab": 301}  # the corpus tokenizer needs 300
    hf_dir = tmp_path / "OLMoE-tiny"
    random_hf_model(fmt, **shape).save_pretrained(hf_dir)
    ckpt = tmp_path / "imported"
    assert run_without_user_warnings(["checkpoint", "import", str(hf_dir), "--out", str(ckpt)]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert (ckpt / "model" / "olmoe-tiny.yaml").is_file() and "checkpoint.load_weights_only=true" in command
    assert main(["checkpoint", "import", str(hf_dir), "--out", str(ckpt)]) == 2  # never overwrites

    overrides = shlex.split(command)[2:]  # after `optimus train`
    data = ["data=text", f"data.path={corpus_file}", "data.vocab_size=300", f"run.dir={tmp_path / 'run'}"]
    trainer = Trainer(load_config([*overrides, *data, *TRAIN]))
    reference, _ = from_pretrained(hf_dir)
    for key, value in reference.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[key], value), key
    trainer.fit()

    out = tmp_path / "exported"
    checkpoints = str(tmp_path / "run" / "checkpoints")
    assert run_without_user_warnings(["checkpoint", "export", checkpoints, "--format", "hf", "--out", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens_BS = torch.randint(0, shape["vocab"], (2, 9))
    trainer.model.eval()
    with torch.no_grad():
        trained_logits = trainer.model(tokens_BS)[..., : shape["vocab"]]
        assert not torch.allclose(trained_logits, reference(tokens_BS)[..., : shape["vocab"]])
        assert relative_error(exported(tokens_BS).logits, trained_logits) < 1e-4


def test_export_of_a_model_no_hf_format_holds_is_refused(tmp_path, corpus_file, capsys):
    from tests.conftest import TINY_MODEL

    run = tmp_path / "run"
    data = ["data=text", f"data.path={corpus_file}", "data.vocab_size=300", f"run.dir={run}"]
    Trainer(load_config([*TINY_MODEL, "model.moe.router=sigmoid", *data, *TRAIN])).fit()
    assert main(["checkpoint", "export", str(run / "checkpoints"), "--format", "hf", "--out", str(tmp_path / "x")]) == 2
    assert "router is sigmoid" in capsys.readouterr().err
