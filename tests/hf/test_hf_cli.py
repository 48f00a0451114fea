"""`optimus checkpoint import` -> continued pretraining with the printed command -> `export --format hf`:
the exported directory gives transformers the trained model's logits. What the import writes and prints (the
source's objective, absolute paths, the data keys to fill in), and a start from its weights in a model that
computes otherwise (refused unless confirmed)."""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import warnings

import pytest
import torch
import yaml

from optimus.cli import load_config, main
from optimus.config import MoEConfig
from optimus.hf import from_pretrained
from optimus.train.trainer import Trainer
from tests.hf.test_hf import CASES, random_hf_model, relative_error
from tests.unchanged import unchanged

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


def hf_dir_with_tokenizer(path, tok_file, fmt="olmoe", **changes):
    """A random HF model of CASES' OLMoE shape (vocabulary 333: the test tokenizer has 320) and a tokenizer."""
    shape = {**CASES["olmoe-gqa-top8"][1], "vocab": 333, **changes}
    random_hf_model(fmt, **shape).save_pretrained(path)
    shutil.copyfile(tok_file, path / "tokenizer.json")
    return path


def printed_command(capsys, corpus_file) -> list[str]:
    """The overrides of the `optimus train` command `checkpoint import` printed last, its data filled in."""
    command = capsys.readouterr().out.strip().splitlines()[-1].replace("DATA_PATH", str(corpus_file))
    assert shlex.split(command)[:2] == ["optimus", "train"]
    return shlex.split(command)[2:]


def test_import_continue_pretraining_and_export(tmp_path, corpus_file, tok_file, capsys):
    hf_dir = hf_dir_with_tokenizer(tmp_path / "OLMoE-tiny", tok_file)
    ckpt = tmp_path / "imported"
    assert run_without_user_warnings(["checkpoint", "import", str(hf_dir), "--out", str(ckpt)]) == 0
    overrides = printed_command(capsys, corpus_file)
    assert (ckpt / "model" / "olmoe-tiny.yaml").is_file() and "checkpoint.load_weights_only=true" in overrides
    assert main(["checkpoint", "import", str(hf_dir), "--out", str(ckpt)]) == 2  # never overwrites

    trainer = Trainer.from_config(load_config([*overrides, f"run.dir={tmp_path / 'run'}", *TRAIN]))
    reference, _ = from_pretrained(hf_dir)
    for key, value in reference.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[key], value), key
    trainer.fit()

    out = tmp_path / "exported"
    checkpoints = str(tmp_path / "run" / "checkpoints")
    assert run_without_user_warnings(["checkpoint", "export", checkpoints, "--format", "hf", "--out", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens_BS = torch.randint(0, 333, (2, 9))
    trainer.model.eval()
    with torch.no_grad():
        trained_logits = trainer.model(tokens_BS)[..., :333]
        assert not torch.allclose(trained_logits, reference(tokens_BS)[..., :333])
        assert relative_error(exported(tokens_BS).logits, trained_logits) < 1e-4


def test_export_of_a_model_no_hf_format_holds_is_refused(tmp_path, corpus_file, capsys):
    from tests.conftest import TINY_MODEL

    run = tmp_path / "run"
    data = ["data=text", f"data.path={corpus_file}", "data.vocab_size=300", f"run.dir={run}"]
    Trainer.from_config(load_config([*TINY_MODEL, "model.moe.router=sigmoid", *data, *TRAIN])).fit()
    assert main(["checkpoint", "export", str(run / "checkpoints"), "--format", "hf", "--out", str(tmp_path / "x")]) == 2
    assert "router is sigmoid" in capsys.readouterr().err


LOSS_KEYS = ("aux_loss_coef", "aux_loss_layers", "aux_loss_scope", "z_loss_coef", "seq_aux_loss_coef")


def test_imported_recipe_states_its_objective_and_the_command_is_absolute(tmp_path, tok_file, capsys, monkeypatch):
    """Run from the directory that holds both, with relative paths: every path printed is absolute, the
    recipe's loss settings are transformers' (config.json's coefficient, or transformers' default where it gives
    none), each with a comment saying where it came from, and the output says how to get Optimus's instead."""
    hf_dir = hf_dir_with_tokenizer(tmp_path / "Qwen3-tiny", tok_file, fmt="qwen3_moe")
    config = json.loads((hf_dir / "config.json").read_text())
    del config["router_aux_loss_coef"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    assert main(["checkpoint", "import", "Qwen3-tiny", "--out", "ckpt"]) == 0
    wrote, objective, fill_in, command = capsys.readouterr().out.strip().splitlines()
    ckpt = tmp_path / "ckpt"
    assert f"Wrote checkpoint {ckpt} and model recipe {ckpt / 'model' / 'qwen3-tiny.yaml'}." == wrote
    overrides = dict(o.split("=", 1) for o in shlex.split(command)[2:])
    assert overrides["hydra.searchpath"] == f"[file://{ckpt}]" and overrides["checkpoint.load"] == str(ckpt)
    assert overrides["data.tokenizer"] == str(ckpt / "tokenizer.json") and overrides["data.path"] == "DATA_PATH"
    assert "DATA_PATH:" in fill_in and "data=tokens" in fill_in and "TOKENIZER" not in command
    # config.json's output_router_logits=false: transformers' own loss leaves the aux loss out.
    assert "add model.moe.aux_loss_coef=0" in objective
    defaults = MoEConfig()
    assert (
        f"model.moe.aux_loss_layers={defaults.aux_loss_layers} model.moe.z_loss_coef={defaults.z_loss_coef}"
        in objective
    )

    text = (ckpt / "model" / "qwen3-tiny.yaml").read_text()
    moe = yaml.safe_load(text)["moe"]
    reference = transformers.Qwen3MoeConfig()
    assert moe["aux_loss_coef"] == reference.router_aux_loss_coef and moe["aux_loss_layers"] == "pooled"
    assert moe["z_loss_coef"] == 0 and moe["seq_aux_loss_coef"] == 0 and moe["capacity_factor"] is None
    comments = {line.split(":")[0].strip(): line.split("#", 1)[1] for line in text.splitlines() if "  # " in line}
    assert set(LOSS_KEYS) <= comments.keys()
    assert "transformers' default for Qwen3MoeForCausalLM" in comments["aux_loss_coef"]
    assert f"Optimus's default: {defaults.z_loss_coef}" in comments["z_loss_coef"]
    assert "also Optimus's default" in comments["aux_loss_scope"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory, tok_file):
    """An OLMoE import (top_k 8 of 10, norm_topk, rope_theta 10000), read-only."""
    root = tmp_path_factory.mktemp("imported")
    hf_dir_with_tokenizer(root / "hf", tok_file)
    assert main(["checkpoint", "import", str(root / "hf"), "--out", str(root / "ckpt")]) == 0
    return root / "ckpt"


def start_overrides(ckpt, corpus_file, run_dir) -> list[str]:
    command = [f"hydra.searchpath=[file://{ckpt}]", "model=hf", f"checkpoint.load={ckpt}"]
    command += ["checkpoint.load_weights_only=true", "data=text", f"data.path={corpus_file}"]
    return [*command, f"data.tokenizer={ckpt / 'tokenizer.json'}", f"run.dir={run_dir}", *TRAIN[:-1]]


def test_weights_in_a_model_that_computes_otherwise_need_confirming(imported, tmp_path, corpus_file, capsys, caplog):
    """Same shapes, another top_k, norm_topk and RoPE base: refused in one sentence naming the three (not the
    z-loss, which changes the objective, not what the weights compute); with the confirming key the run starts
    from the weights and one line names every difference."""
    changed = ["model.moe.top_k=3", "model.moe.norm_topk=false", "model.rope_theta=5e5", "model.moe.z_loss_coef=0.01"]
    refused_run = tmp_path / "refused"
    capsys.readouterr()
    with unchanged(imported, refused_run):
        assert main(["train", *start_overrides(imported, corpus_file, refused_run), *changed]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith(
        "checkpoint.allow_architecture_change=true to train its weights in the changed model."
    ), err
    assert "model.moe.top_k=8" in err and "model.moe.norm_topk=true" in err and "model.rope_theta=10000.0" in err
    assert "z_loss_coef" not in err

    allowed = [*start_overrides(imported, corpus_file, tmp_path / "allowed"), *changed]
    with caplog.at_level(logging.WARNING, logger="optimus.checkpoint"):
        assert main(["train", *allowed, "checkpoint.allow_architecture_change=true"]) == 0
    named = [r.getMessage() for r in caplog.records if "differ from those checkpoint" in r.getMessage()]
    assert len(named) == 1, named
    for difference in ("model.rope_theta 10000.0 -> 500000.0", "model.moe.top_k 8 -> 3",
                       "model.moe.norm_topk true -> false", "model.moe.z_loss_coef 0.0 -> 0.01"):  # fmt: skip
        assert difference in named[0], named[0]

    unloaded = [o for o in start_overrides(imported, corpus_file, tmp_path / "new") if "checkpoint.load" not in o]
    assert main(["train", *unloaded, "checkpoint.allow_architecture_change=true"]) == 2
    assert "checkpoint.allow_architecture_change=true needs checkpoint.load=PATH" in capsys.readouterr().err
