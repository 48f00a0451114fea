"""Hugging Face interop: logits of imported OLMoE / Qwen3-MoE / Mixtral models equal transformers' logits
(fp32, relative 1e-4) for several shapes, and the round trip transformers -> Optimus -> transformers.

Reference models are built by transformers from configs with random weights; nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch

from optimus.config import ConfigError, ModelConfig, MoEConfig
from optimus.hf import from_pretrained, save_pretrained
from optimus.model import Transformer

transformers = pytest.importorskip("transformers")

# (format, shape): MHA and GQA, top-k 1..8, expert counts that are not powers of two, vocab not a multiple of 128.
CASES = {
    "olmoe-mha-top1": ("olmoe", dict(heads=4, kv=4, experts=3, top_k=1, vocab=301)),
    "olmoe-gqa-top8": ("olmoe", dict(heads=4, kv=2, experts=10, top_k=8, vocab=200, norm_topk=True)),
    "qwen3-gqa-top2-dense0": ("qwen3_moe", dict(heads=8, kv=2, experts=7, top_k=2, vocab=130, dense=1)),
    "qwen3-mha-top5": ("qwen3_moe", dict(heads=4, kv=4, experts=6, top_k=5, vocab=257, norm_topk=True)),
    "mixtral-gqa-top2": ("mixtral", dict(heads=4, kv=1, experts=5, top_k=2, vocab=333)),
    "mixtral-mha-top3-tied": ("mixtral", dict(heads=2, kv=2, experts=9, top_k=3, vocab=100, tied=True)),
}
DIM, EXPERT_DIM, DENSE_DIM, LAYERS = 32, 24, 40, 3


def hf_config(fmt: str, heads, kv, experts, top_k, vocab, norm_topk=False, dense=0, tied=False):
    common = dict(
        vocab_size=vocab, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=heads,
        num_key_value_heads=kv, num_experts_per_tok=top_k, tie_word_embeddings=tied,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    if fmt == "olmoe":
        return transformers.OlmoeConfig(
            **common, intermediate_size=EXPERT_DIM, num_experts=experts, norm_topk_prob=norm_topk, rms_norm_eps=1e-5
        )
    if fmt == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, intermediate_size=DENSE_DIM, moe_intermediate_size=EXPERT_DIM, num_experts=experts,
            head_dim=DIM // heads, norm_topk_prob=norm_topk, mlp_only_layers=list(range(dense)),
        )  # fmt: skip
    return transformers.MixtralConfig(
        **common, intermediate_size=EXPERT_DIM, num_local_experts=experts, rope_parameters={"rope_theta": 5e5}
    )


def random_hf_model(fmt: str, seed: int = 0, **shape):
    """A transformers model whose every weight is random (norm weights near 1, so they matter)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(fmt, **shape)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.2 * torch.randn_like(p))
    return model


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """A random HF model saved by transformers, and the tokens to compare logits on."""
    fmt, shape = CASES[request.param]
    model = random_hf_model(fmt, **shape)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tokens_BS = torch.randint(0, shape["vocab"], (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_logits = model(tokens_BS).logits
    return request.param, fmt, shape, path, tokens_BS, ref_logits


def optimus_logits(model: Transformer, cfg: ModelConfig, tokens_BS: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens_BS)[..., : cfg.vocab_size]  # the model pads the vocabulary


def test_imported_model_gives_transformers_logits(case):
    name, fmt, shape, path, tokens_BS, ref_logits = case
    model, cfg = from_pretrained(path, kernels="torch")
    assert cfg.vocab_size == shape["vocab"] and cfg.moe.top_k == shape["top_k"]
    assert cfg.qk_norm == {"olmoe": "full", "qwen3_moe": "head", "mixtral": "none"}[fmt]
    assert cfg.first_k_dense == shape.get("dense", 0)
    err = relative_error(optimus_logits(model, cfg, tokens_BS), ref_logits)
    print(f"parity {name}: import max|diff|/max|logit| = {err:.2e}")
    assert err < 1e-4


def test_round_trip_through_optimus_gives_the_same_logits(case, tmp_path):
    name, fmt, shape, path, tokens_BS, ref_logits = case
    model, cfg = from_pretrained(path, kernels="torch")
    save_pretrained(model, cfg, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == fmt and written["vocab_size"] == shape["vocab"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        err = relative_error(reloaded(tokens_BS).logits, ref_logits)
    print(f"parity {name}: round trip max|diff|/max|logit| = {err:.2e}")
    assert err < 1e-4


def test_sharded_directory_with_index_loads_the_same(tmp_path):
    fmt, shape = CASES["qwen3-gqa-top2-dense0"]
    model, cfg = from_pretrained_of(random_hf_model(fmt, seed=3, **shape), tmp_path / "hf")
    save_pretrained(model, cfg, tmp_path / "sharded", max_shard_bytes=20_000, dtype=torch.bfloat16)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    again, _ = from_pretrained(tmp_path / "sharded", kernels="torch")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], value.to(torch.bfloat16).float(), rtol=0, atol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    tokens_BS = torch.randint(0, shape["vocab"], (1, 7))
    with torch.no_grad():
        assert relative_error(optimus_logits(again, cfg, tokens_BS), hf(tokens_BS).logits) < 1e-4


def from_pretrained_of(hf_model, path):
    hf_model.save_pretrained(path)
    return from_pretrained(path, kernels="torch")


def test_tokenizer_files_travel_with_the_model(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    fmt, shape = CASES["olmoe-mha-top1"]
    model, cfg = from_pretrained_of(random_hf_model(fmt, **shape), tmp_path / "hf")
    vocab = {f"w{i}": i for i in range(shape["vocab"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    for name, tokenizer in (("object", tok), ("file", tmp_path / "tok.json")):
        save_pretrained(model, cfg, tmp_path / name, tokenizer=tokenizer)
        loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / name)
        assert loaded("w5 w7")["input_ids"] == [5, 7], name


def test_unsupported_models_are_refused_with_a_reason(tmp_path):
    fmt, shape = CASES["olmoe-mha-top1"]
    random_hf_model(fmt, **shape).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "clip_qkv": 8.0}))
    with pytest.raises(ConfigError, match="clip_qkv"):
        from_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": LAYERS + 1}))
    with pytest.raises(ConfigError, match="lacks .* tensors"):
        from_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "head_dim": 16}))
    with pytest.raises(ConfigError, match="shape"):
        from_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match="config.json"):
        from_pretrained(tmp_path)
    sigmoid = ModelConfig(n_layers=1, dim=32, n_heads=4, n_kv_heads=4, vocab_size=100, moe=MoEConfig(router="sigmoid"))
    with pytest.raises(ConfigError, match="router is sigmoid"):
        save_pretrained(Transformer(sigmoid), sigmoid, tmp_path / "x")
