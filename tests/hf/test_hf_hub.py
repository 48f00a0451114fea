"""`optimus checkpoint import ORG/NAME`: a Hugging Face Hub id, read from huggingface_hub's cache (HF_HOME) as
transformers would. The commands run in a fresh process with HF_HUB_OFFLINE=1 and HF_HOME in the test's
directory (huggingface_hub reads both when imported): an empty cache gives one sentence, a cache that holds the
model (laid out as huggingface_hub lays out a download) imports it. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from optimus.checkpoint_export import consolidated_state
from optimus.cli import main
from optimus.hf import from_pretrained
from optimus.hf.hub import is_hub_id
from tests.hf.test_hf import CASES, random_hf_model
from tests.unchanged import unchanged

pytest.importorskip("transformers")

REPO_ID = "tiny-org/OLMoE-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def offline_import(tmp_path, repo_id: str, out) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    env.pop("HF_HUB_CACHE", None)  # HF_HOME decides where the cache is
    command = [sys.executable, "-m", "optimus", "checkpoint", "import", repo_id, "--out", str(out)]
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_offline_with_an_empty_cache_is_one_sentence(tmp_path):
    (tmp_path / "hf-home").mkdir()
    with unchanged(tmp_path):
        done = offline_import(tmp_path, REPO_ID, tmp_path / "ckpt")
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    assert "\n" not in err and "Traceback" not in err and err.endswith("."), err
    assert f"{REPO_ID} is not in the Hugging Face cache" in err and "HF_HUB_OFFLINE=1" in err, err


def test_a_cached_hub_model_is_imported_offline(tmp_path):
    """The cache as huggingface_hub writes it: models--ORG--NAME/refs/main names the commit whose files are in
    snapshots/COMMIT/."""
    fmt, shape = CASES["olmoe-mha-top1"]
    repo = tmp_path / "hf-home" / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    random_hf_model(fmt, **shape).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)

    done = offline_import(tmp_path, REPO_ID, "ckpt")
    assert done.returncode == 0, done.stderr
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "model" / "olmoe-tiny.yaml").is_file()  # the recipe is named after the model, not the commit
    assert REPO_ID in json.loads((ckpt / "meta.json").read_text())["imported_from"]
    reference, _ = from_pretrained(snapshot)
    imported = consolidated_state(ckpt)
    for key, value in reference.state_dict().items():
        assert torch.equal(imported[key], value), key


def test_the_output_is_checked_before_the_hub_is_asked(tmp_path, capsys, monkeypatch):
    import optimus.hf.convert as convert

    monkeypatch.setattr(convert, "hub_snapshot", lambda repo_id: pytest.fail(f"{repo_id} was looked up"))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "mine.txt").write_text("the user's")
    with unchanged(tmp_path):
        assert main(["checkpoint", "import", REPO_ID, "--out", str(tmp_path / "ckpt")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("allenai/OLMoE-1B-7B-0924") and is_hub_id("gpt2")
    for path in ("./model", "/models/olmoe", "~/olmoe", "a/b/c", "model.safetensors"):
        assert not is_hub_id(path), path
    (tmp_path / "allenai" / "OLMoE-1B-7B-0924").mkdir(parents=True)  # a local copy under the same name wins
    assert not is_hub_id("allenai/OLMoE-1B-7B-0924")
