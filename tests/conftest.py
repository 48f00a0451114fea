"""Shared fixtures: a small local corpus and tiny-model overrides, so no test downloads anything."""

import json
import random

import pytest

TINY_MODEL = [
    "model.n_layers=2",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.moe.n_experts=4",
    "model.moe.top_k=2",
    "model.moe.expert_dim=64",
    "model.vocab_size=512",
    "data.vocab_size=512",
]


def write_corpus(path, n_docs=400, seed=0):
    """Documents of simple, learnable sentences (so a short run's loss clearly falls)."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my robot", "the expert", "a router", "the model", "our cluster"]
    verbs = ["routes", "eats", "trains", "sorts", "sends", "reads", "writes"]
    objects = ["tokens", "fish", "gradients", "numbers", "bytes", "letters", "shards"]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_docs):
            sentences = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(12)]
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """Tokenizers and token caches of tests go to a per-session temp dir, never the user's cache."""
    monkeypatch.setenv("OPTIMUS_CACHE", str(tmp_path_factory.getbasetemp() / "optimus-cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
