"""Shared fixtures: a small local corpus and tiny-model overrides, so no test downloads anything."""

import json
import os
import random

import pytest
import torch

from optimus.fake_device import stand_in

# Triton fixes compiled-or-interpreted when it is first imported, and with a CUDA build of torch (what a plain
# `pip install torch` gives) importing torch._dynamo, as some optimus modules do, imports it: without a GPU the
# Triton tests need the interpreter, so it is chosen here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The dry runs' stand-in device (optimus.fake_device), registered before any test runs a backward: the autograd
# engine sizes its device queues at a process's first backward, as `optimus plan` does in its own process. Not
# where a GPU is: once registered, the stand-in is torch's accelerator, and a real GPU's backward fails inside the
# engine (seen on an H200 with torch 2.11), so there the GPU's tests run and a dry run's registers it when it runs.
if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    stand_in("cuda")

# The tests' small MoE, trained with AdamW at 3e-3 (its best lr on the tiny model): under AdamW every layout matches
# one process within fp32 rounding, while the default run's Muon iterates in bf16, where layouts part by a bf16 unit
# (docs/ARCHITECTURE.md, "Muon"). A later `optim.update=muon` wins; tests/optim/test_muon.py holds Muon to its bounds.
TINY_MODEL = [
    "optim.update=adamw",
    "optim.lr=3e-3",
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


@pytest.fixture(scope="session")
def tok_file(tmp_path_factory):
    """A small BPE tokenizer file (vocabulary 320), trained once per session; read-only for tests."""
    from optimus.data import train_bpe

    path = tmp_path_factory.mktemp("tok") / "tok.json"
    texts = ["the quick brown fox jumps over the lazy dog. 0123456789 " * 40, "Grüße, ñandú! " * 20]
    train_bpe(texts, 320).save(str(path))
    return path


@pytest.fixture
def one_thread():
    """Tiny tensors: a second thread only contends with whatever else runs on the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def single_threaded(monkeypatch):
    """One intra-op thread per rank for multi-process runs: 4 ranks share 2 cores (children inherit it)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """Tokenizers and token caches of tests go to a per-session temp dir, never the user's cache."""
    monkeypatch.setenv("OPTIMUS_CACHE", str(tmp_path_factory.getbasetemp() / "optimus-cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")


# What the tests' short CPU runs share: TINY_MODEL made smaller, fp32 with the torch kernels (exact and
# fast on any CPU), sequences of 16 tokens in global batches of 8, and no progress bar.
SMALL_MODEL_RUN = [
    *TINY_MODEL,
    "model.dim=32",
    "model.moe.expert_dim=32",
    "train.dtype=fp32",
    "kernels=torch",
    "logging.progress=false",
    "train.seq_len=16",
    "train.global_batch=8",
]

# A small finished run, trained once per session and shared: tests copy it (copy_small_run) before changing it.
SMALL_RUN = [
    *SMALL_MODEL_RUN,
    "train.micro_batch=4",
    "train.eval_sequences=8",
    "train.eval_interval=2",
    "optim.warmup_steps=1",
    "checkpoint.interval=2",
    "checkpoint.keep=3",
    "train.steps=4",
]


@pytest.fixture(scope="session")
def small_run(tmp_path_factory, corpus_file):
    """(run directory with checkpoints at steps 2 and 4, the overrides that made it); read-only for tests."""
    from optimus.cli import load_config
    from optimus.train.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("small-run") / "run"
    overrides = [*SMALL_RUN, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}"]
    with pytest.MonkeyPatch.context() as mp:  # the function-scoped isolated_cache does not reach here
        mp.setenv("OPTIMUS_CACHE", str(tmp_path_factory.getbasetemp() / "optimus-cache"))
        Trainer.from_config(load_config(overrides)).fit()
    return run_dir, overrides


def copy_small_run(small_run, tmp_path):
    """A private copy of the small run: (its run directory, the overrides that resume it)."""
    import shutil

    source, overrides = small_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    return run_dir, [o for o in overrides if not o.startswith("run.dir=")] + [f"run.dir={run_dir}"]
