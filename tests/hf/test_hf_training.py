"""Training parity with transformers: a random OLMoE / Qwen3-MoE (three MoE layers, a vocabulary of 1000, not a
multiple of 128) saved by transformers, imported with `optimus checkpoint import`, trained 10 fp32 steps by the
Trainer with the command the import prints, and by a plain PyTorch loop around the transformers model: the loss
of every step agrees within 1e-5.

The loop is the reference a migrating user would write: torch.optim.AdamW with Optimus's betas, weight decay on
the matrices only, the warmup + cosine schedule written out here, clip_grad_norm_, and per micro-batch the
cross-entropy plus router_aux_loss_coef x the aux loss transformers' model computes itself
(load_balancing_loss_func over its router logits). Both sides use AdamW eps 1e-6: at 1e-8, gradient elements
near 1e-8 make single Adam steps depend on last-bit rounding. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import shlex

import pytest
import torch
import torch.nn.functional as F

from optimus.cli import load_config, main
from optimus.config import OptimConfig
from optimus.train.trainer import Trainer
from tests.hf.test_hf import random_hf_model

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB, STEPS, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH = 1000, 10, 16, 4, 2
SHAPES = {
    "olmoe": dict(heads=4, kv=2, experts=6, top_k=2, vocab=VOCAB),
    "qwen3_moe": dict(heads=4, kv=2, experts=5, top_k=2, vocab=VOCAB, norm_topk=True),
}
# Optimus's defaults otherwise, on both sides; lr 6e-3 so that 10 steps move the loss by more than 0.1
OPTIM = OptimConfig(lr=6e-3, warmup_steps=3, eps=1e-6)
TRAIN = [
    "train.dtype=fp32", "kernels=torch", "logging.progress=false", f"train.steps={STEPS}",
    f"train.seq_len={SEQ_LEN}", f"train.global_batch={GLOBAL_BATCH}", f"train.micro_batch={MICRO_BATCH}",
    f"train.eval_interval={STEPS}", "train.eval_sequences=2", f"optim.warmup_steps={OPTIM.warmup_steps}",
    f"optim.eps={OPTIM.eps}", f"optim.lr={OPTIM.lr}",
]  # fmt: skip


def word_tokenizer(path) -> None:
    """A tokenizer.json of VOCAB words (w1 ... w999 and the end-of-document token)."""
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))


def word_corpus(path) -> None:
    gen = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(40):
            words = torch.randint(1, VOCAB, (int(torch.randint(20, 60, (1,), generator=gen)),), generator=gen)
            f.write(json.dumps({"text": " ".join(f"w{i}" for i in words.tolist())}) + "\n")


def reference_lr(step: int) -> float:
    """Linear warmup to the peak over the first steps, then a cosine to min_lr_ratio x peak at the last step."""
    peak, warmup = OPTIM.lr, OPTIM.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step + 1 - warmup) / (STEPS - warmup)
    return peak * OPTIM.min_lr_ratio + 0.5 * peak * (1 - OPTIM.min_lr_ratio) * (1 + math.cos(math.pi * progress))


def optimus_run(tmp_path, hf_dir, corpus, capsys) -> tuple[list[dict], list[list[torch.Tensor]]]:
    """Import `hf_dir`, then train with the printed command (its data placeholder filled in); returns the
    metrics of each step and each step's micro-batches."""
    assert main(["checkpoint", "import", str(hf_dir), "--out", str(tmp_path / "imported")]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1].replace("DATA_PATH", str(corpus))
    trainer = Trainer.from_config(load_config([*shlex.split(command)[2:], *TRAIN, f"run.dir={tmp_path / 'run'}"]))
    batches, next_step = [], trainer.loader.next_step
    trainer.loader.next_step = lambda: batches.append(next_step()) or batches[-1]
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], batches


def transformers_run(hf_dir, batches: list[list[torch.Tensor]]) -> list[dict]:
    """The same steps by a plain loop around the transformers model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    matrices = [p for p in model.parameters() if p.dim() >= 2]  # Optimus decays matrices, not norms
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": OPTIM.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    records = []
    for step, micro_batches in enumerate(batches):
        losses = []
        for window_BS1 in micro_batches:
            # The model sees the inputs only: given labels it would route the last target token too.
            out = model(input_ids=window_BS1[:, :-1], output_router_logits=True)
            lm_loss = F.cross_entropy(out.logits.flatten(0, 1), window_BS1[:, 1:].flatten())
            loss = lm_loss + model.config.router_aux_loss_coef * out.aux_loss
            (loss / len(micro_batches)).backward()
            losses.append(loss.item())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0).item()
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(step)
        optimizer.step()
        optimizer.zero_grad()
        records.append({"loss": sum(losses) / len(losses), "grad_norm": grad_norm, "lr": reference_lr(step)})
    return records


@pytest.mark.parametrize("fmt", list(SHAPES))
def test_imported_model_trains_as_transformers_trains_it(fmt, tmp_path, capsys):
    hf_dir = tmp_path / f"{fmt}-tiny"
    hf_model = random_hf_model(fmt, **SHAPES[fmt])
    assert hf_model.config.router_aux_loss_coef > 0  # the aux loss is on: the pooled form is what is compared
    hf_model.save_pretrained(hf_dir)
    word_tokenizer(hf_dir / "tokenizer.json")  # the import copies it and names it in the command
    word_corpus(tmp_path / "corpus.jsonl")

    optimus, batches = optimus_run(tmp_path, hf_dir, tmp_path / "corpus.jsonl", capsys)
    reference = transformers_run(hf_dir, batches)
    assert len(optimus) == len(reference) == STEPS
    worst = max(abs(o["loss"] - r["loss"]) for o, r in zip(optimus, reference))
    worst_norm = max(abs(o["grad_norm"] / r["grad_norm"] - 1) for o, r in zip(optimus, reference))
    print(f"{fmt}: over {STEPS} steps max |loss diff| {worst:.2e}, max grad-norm relative diff {worst_norm:.2e}")
    for step, (got, want) in enumerate(zip(optimus, reference), start=1):
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12), step
        assert abs(got["loss"] - want["loss"]) < 1e-5, (step, got["loss"], want["loss"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), step
    assert optimus[-1]["loss"] < optimus[0]["loss"] - 0.1  # it trained
