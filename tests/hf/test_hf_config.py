"""optimus.hf without transformers: config mapping both ways, the formats a model can be written in,
an Optimus -> HF directory -> Optimus round trip, and the qk_norm choices against a plain reference."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from optimus.config import ConfigError, ModelConfig, MoEConfig
from optimus.config_checks import validate_model
from optimus.hf import MIXTRAL, OLMOE, QWEN3_MOE, format_for_model, from_pretrained, save_pretrained
from optimus.hf.config_map import TRANSFORMERS_LOSSES, hf_config_from_model, model_config_from_hf
from optimus.kernels.rope import apply_rope
from optimus.model import Transformer
from optimus.model.attention import Attention, rope_tables

SHAPE = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=300, rope_theta=5e5, norm_eps=1e-6)


def config(qk_norm: str, **overrides) -> ModelConfig:
    """A model that a HF directory holds whole: its router losses are those transformers trains with."""
    moe = MoEConfig(n_experts=5, top_k=3, expert_dim=24, norm_topk=True, aux_loss_coef=0.02, **TRANSFORMERS_LOSSES)
    return ModelConfig(**{**SHAPE, "name": "m", "qk_norm": qk_norm, "moe": moe, **overrides})


@pytest.mark.parametrize(
    "cfg, fmt",
    [
        (config("full"), OLMOE),
        (config("head", first_k_dense=1, ffn_dim=40), QWEN3_MOE),
        (config("none", tie_embeddings=True), MIXTRAL),
    ],
)
def test_config_maps_to_hf_and_back(cfg, fmt):
    assert format_for_model(cfg) is fmt
    hf = json.loads(json.dumps(hf_config_from_model(cfg, fmt)))  # what config.json holds
    back, back_fmt = model_config_from_hf(hf, "m")
    assert back_fmt is fmt and back == cfg


@pytest.mark.parametrize(
    "cfg, match",
    [
        (config("none", moe=MoEConfig(n_experts=4, top_k=2)), "norm_topk"),
        (config("full", first_k_dense=1), "dense layers"),
        (config("full", moe=MoEConfig(n_experts=4, n_shared_experts=1)), "shared experts"),
        (config("head", moe=MoEConfig(n_experts=4, n_groups=2)), "group-limited"),
        (config("full", moe=MoEConfig(n_experts=0)), "dense model"),
    ],
)
def test_models_no_hf_format_holds_are_refused(cfg, match):
    with pytest.raises(ConfigError, match=match):
        format_for_model(cfg)


def test_optimus_model_survives_a_hf_directory(tmp_path):
    cfg = config("head", first_k_dense=1, ffn_dim=40)
    torch.manual_seed(0)
    model = Transformer(cfg, kernels="torch")
    model.init_weights()
    save_pretrained(model, cfg, tmp_path / "hf", max_shard_bytes=10_000)
    loaded, loaded_cfg = from_pretrained(tmp_path / "hf", kernels="torch", name="m")
    assert loaded_cfg == cfg
    for key, value in loaded.state_dict().items():
        original = model.state_dict()[key]
        if key in ("embed.weight", "lm_head.weight"):  # the padding rows are not exported; they come back 0
            assert not value[cfg.vocab_size :].any()
            value, original = value[: cfg.vocab_size], original[: cfg.vocab_size]
        assert torch.equal(value, original), key
    tokens_BS = torch.randint(0, cfg.vocab_size, (2, 7))
    with torch.no_grad():
        want = model(tokens_BS)[..., : cfg.vocab_size]
        torch.testing.assert_close(loaded(tokens_BS)[..., : cfg.vocab_size], want)


@pytest.mark.parametrize("legacy, mode", [(True, "full"), ("True", "full"), (False, "none"), ("false", "none")])
def test_boolean_qk_norm_of_old_configs_keeps_its_meaning(legacy, mode):
    cfg = ModelConfig(**SHAPE, qk_norm=legacy)
    validate_model(cfg)
    assert Attention(cfg).qk_norm == mode


def test_bad_qk_norm_is_a_config_error():
    with pytest.raises(ConfigError, match="model.qk_norm"):
        validate_model(ModelConfig(**SHAPE, qk_norm="per_head"))


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
def test_attention_qk_norm_choices_match_a_plain_reference(qk_norm):
    cfg = ModelConfig(**SHAPE, qk_norm=qk_norm)
    torch.manual_seed(0)
    attn = Attention(cfg)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.3 * torch.randn_like(p))
    B, S, N, NKV, H = 2, 5, 4, 2, 8
    x = torch.randn(B, S, 32)
    q, k, v = x @ attn.wq.weight.T, x @ attn.wk.weight.T, x @ attn.wv.weight.T
    if qk_norm == "full":  # over the whole projection: one RMS per token for all heads together
        q, k = rms(q, attn.q_norm.weight, 1e-6), rms(k, attn.k_norm.weight, 1e-6)
    q, k, v = q.view(B, S, N, H), k.view(B, S, NKV, H), v.view(B, S, NKV, H)
    if qk_norm == "head":  # one RMS per head, the same H weights for every head
        q, k = rms(q, attn.q_norm.weight, 1e-6), rms(k, attn.k_norm.weight, 1e-6)
    cos, sin = rope_tables(S, H, 5e5, x.device)
    q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
    k, v = k.repeat_interleave(N // NKV, dim=1), v.transpose(1, 2).repeat_interleave(N // NKV, dim=1)
    scores = (q @ k.transpose(-1, -2)) / H**0.5 + torch.full((S, S), float("-inf")).triu(1)
    out = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, S, 32) @ attn.wo.weight.T
    torch.testing.assert_close(attn(x), out, rtol=1e-5, atol=1e-5)
