"""The transformer: causality, shapes, init, parameter counts of the Mula recipes."""

import pytest
import torch

from optimus.cli import load_config
from optimus.config import ModelConfig, MoEConfig
from optimus.model import (
    Transformer,
    count_params,
    count_params_of_config,
    flops_per_token,
    moe_layer_ids,
    padded_vocab_size,
)
from optimus.model.moe import RouterStats


def tiny_config(**overrides) -> ModelConfig:
    base = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=100, ffn_dim=48)
    base.update(overrides)
    return ModelConfig(moe=MoEConfig(n_experts=4, top_k=2, expert_dim=24), **base)


@pytest.mark.parametrize("first_k_dense", [0, 1])
def test_model_is_causal(first_k_dense):
    torch.manual_seed(0)
    model = Transformer(tiny_config(first_k_dense=first_k_dense), kernels="torch")
    model.init_weights(torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 100, (1, 12))
    changed = tokens.clone()
    changed[0, 7] = (tokens[0, 7] + 1) % 100
    logits = model(tokens)[..., :100]  # the padding rows' logits are -inf
    logits_changed = model(changed)[..., :100]
    # Earlier positions agree up to summation-order noise; later ones move by far more.
    assert (logits[:, :7] - logits_changed[:, :7]).abs().max() < 1e-6
    assert (logits[:, 7:] - logits_changed[:, 7:]).abs().amax(dim=-1).min() > 1e-4


def test_vocab_is_padded_and_embeddings_tie():
    assert padded_vocab_size(100) == 128 and padded_vocab_size(50304) == 50304 and padded_vocab_size(8193) == 8320
    model = Transformer(tiny_config(tie_embeddings=True), kernels="torch")
    assert model.lm_head.weight is model.embed.weight
    assert model.embed.weight.shape == (128, 32)
    counts = count_params(model, model.cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())


def test_init_scales_residual_projections():
    cfg = tiny_config(n_layers=8, dim=256, n_heads=4, n_kv_heads=4)
    model = Transformer(cfg, kernels="torch")
    model.init_weights(torch.Generator().manual_seed(0))
    std = model.layers["0"].attn.wq.weight.std().item()
    residual_std = model.layers["0"].attn.wo.weight.std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(residual_std - 0.02 / 4.0) < 0.0005  # 1 / sqrt(2 * 8 layers)
    assert (model.norm.weight == 1).all()
    assert abs(model.embed.weight.std().item() - 0.02) < 0.002  # embed_init_std null: init_std


def test_embedding_draws_with_its_own_std():
    model = Transformer(tiny_config(dim=256, embed_init_std=1.0), kernels="torch")
    model.init_weights(torch.Generator().manual_seed(0))
    assert abs(model.embed.weight.std().item() - 1.0) < 0.05  # 128 x 256 draws
    assert abs(model.lm_head.weight.std().item() - 0.02) < 0.002  # the head keeps init_std
    assert abs(model.layers["0"].attn.wq.weight.std().item() - 0.02) < 0.002
    tied = Transformer(tiny_config(dim=256, embed_init_std=1.0, tie_embeddings=True), kernels="torch")
    tied.init_weights(torch.Generator().manual_seed(0))
    assert abs(tied.embed.weight.std().item() - 0.02) < 0.002  # the tied matrix is the head too


def test_dense_model_has_no_router_losses():
    cfg = ModelConfig(
        n_layers=2, dim=32, n_heads=4, n_kv_heads=4, vocab_size=100, ffn_dim=48, moe=MoEConfig(n_experts=0)
    )
    model = Transformer(cfg, kernels="torch")
    stats = RouterStats(moe_layer_ids(cfg), cfg.moe.n_experts)
    model.attach_router_stats(stats)
    model(torch.randint(0, 100, (2, 5)))
    assert stats.micro_batch_means(1).tolist() == [[0.0, 0.0, 0.0]] and stats.tokens_per_expert() is None
    assert count_params(model, model.cfg).expert == 0


# The table: (total, active) parameters, matched within 2%.
MULA = {
    "mula-1b": (1.2e9, 1.2e9),
    "mula-7b-a1b": (6.9e9, 1.3e9),
    "mula-20b-a2b": (20.1e9, 2.4e9),
    "mula-100b-a7b": (100e9, 7.6e9),
    "mula-220b-a10b": (220e9, 10e9),
}


@pytest.mark.parametrize("recipe", sorted(MULA))
def test_mula_recipe_parameter_counts(recipe):
    cfg = load_config([f"model={recipe}"])
    counts = count_params_of_config(cfg.model)
    total, active = MULA[recipe]
    assert abs(counts.total / total - 1) < 0.02, counts
    assert abs(counts.active / active - 1) < 0.02, counts
    assert counts.dense + counts.expert == counts.total


def test_flops_per_token_formula():
    cfg = tiny_config()
    counts = count_params(Transformer(cfg, kernels="torch"), cfg)
    expected = 6 * (counts.active - counts.embedding) + 12 * cfg.n_layers * cfg.dim * 64
    assert flops_per_token(counts, cfg, seq_len=64) == expected
