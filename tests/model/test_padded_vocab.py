"""A vocabulary of 1000 tokens, padded to 1024 rows of the embedding and the LM head, is a 1000-way softmax:
the fused loss (training, evaluation), the returned logits (the pipeline's loss, generation, export) and the
gradients equal those of the first 1000 logits alone, made here by hand from the final hidden states. The
vocab-parallel loss under tensor parallelism: tests/model/test_load_balancing_layers.py (tensor parallel)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from optimus.config import ModelConfig, MoEConfig
from optimus.model import Transformer
from tests.model.test_loss import assert_relative_error

VOCAB = 1000


def padded_model(tie: bool) -> Transformer:
    moe = MoEConfig(n_experts=4, top_k=2, expert_dim=24)
    cfg = ModelConfig(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, tie_embeddings=tie, moe=moe)
    model = Transformer(cfg, kernels="torch")
    model.init_weights(0)
    assert model.lm_head.weight.shape[0] == 1024
    with torch.no_grad():  # padding rows that would win every softmax if they took part
        model.lm_head.weight[VOCAB:] = 5 * model.lm_head.weight[:24].abs().sum(0)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def real_logits(model: Transformer, inputs: torch.Tensor) -> torch.Tensor:
    """The logits of the 1000 real tokens, from the final norm's output and the head's first 1000 rows."""
    hidden = []
    handle = model.norm.register_forward_hook(lambda _, __, out: hidden.append(out))
    model(inputs)
    handle.remove()
    return F.linear(hidden[0], model.lm_head.weight[:VOCAB])


def loss_and_grads(model: Transformer, loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    names, params = zip(*model.named_parameters())
    return loss.detach(), dict(zip(names, torch.autograd.grad(loss, params)))


def assert_same(got, expected) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=0)
    assert got[1].keys() == expected[1].keys()
    for name, grad in got[1].items():
        assert_relative_error(grad, expected[1][name])


@pytest.mark.parametrize("tie", [False, True])
def test_fused_loss_is_a_softmax_over_the_real_vocabulary(tie):
    """model(inputs, targets), the training and evaluation loss, against F.cross_entropy over 1000 logits; the
    padding rows of the head (and of the tied embedding) get no gradient."""
    model, (inputs, targets) = padded_model(tie), batch()
    expected = loss_and_grads(model, F.cross_entropy(real_logits(model, inputs).flatten(0, 1), targets.reshape(-1)))
    got = loss_and_grads(model, model(inputs, targets).mean())
    assert_same(got, expected)
    head_grad = got[1]["embed.weight" if tie else "lm_head.weight"]  # tied: one tensor, named once
    assert head_grad[VOCAB:].abs().max() == 0 and head_grad[:VOCAB].abs().max() > 0


def test_logits_give_the_padding_no_probability():
    """The returned logits: the real ones unchanged, -inf on the padding (never chosen, however large its rows);
    a plain cross-entropy of them (the pipeline's last stage) is the 1000-way one, gradients included."""
    model, (inputs, targets) = padded_model(False), batch()
    logits = model(inputs)
    assert logits.shape[-1] == 1024 and torch.isneginf(logits[..., VOCAB:]).all()
    torch.testing.assert_close(logits[..., :VOCAB], real_logits(model, inputs), rtol=0, atol=0)
    assert logits.argmax(-1).max() < VOCAB
    expected = loss_and_grads(model, F.cross_entropy(real_logits(model, inputs).flatten(0, 1), targets.reshape(-1)))
    got = loss_and_grads(model, F.cross_entropy(model(inputs).flatten(0, 1), targets.reshape(-1)))
    assert_same(got, expected)
    assert got[1]["lm_head.weight"][VOCAB:].abs().max() == 0
