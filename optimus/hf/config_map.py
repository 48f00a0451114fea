"""config.json of a Hugging Face MoE model <-> Optimus ModelConfig.

Reading refuses what Optimus does not compute the same way (another activation, RoPE
scaling, attention biases, sliding windows, a head size other than dim / n_heads), so
an imported model either gives the same logits or is not imported at all. Its router
losses are those transformers trains it with (TRANSFORMERS_LOSSES), so that continued
pretraining optimises the source's objective; `loss_sources` says where each came from.
"""

from __future__ import annotations

import json
from typing import Any

from optimus.config import ConfigError, ModelConfig, MoEConfig, moe_aux_loss_coef
from optimus.config_checks import validate_model
from optimus.hf.formats import QWEN3_MOE, HFFormat, format_of_hf_config

DEFAULT_MAX_POSITIONS = 4096  # Optimus has no position limit (RoPE is computed for any length)

# The router losses of transformers' OLMoE, Qwen3-MoE and Mixtral: router_aux_loss_coef x load_balancing_loss_func,
# which pools the counts of every MoE layer of one forward pass, and nothing else (no z-loss, no sequence-wise
# loss, no capacity limit). The aux coefficient comes from config.json.
TRANSFORMERS_LOSSES = dict(
    aux_loss_layers="pooled", aux_loss_scope="micro_batch", z_loss_coef=0.0, seq_aux_loss_coef=0.0,
    capacity_factor=None,
)  # fmt: skip
_WHY_TRANSFORMERS = {
    "aux_loss_layers": "load_balancing_loss_func pools the MoE layers",
    "aux_loss_scope": "it balances each forward pass",
    "z_loss_coef": "it has no router z-loss",
    "seq_aux_loss_coef": "it has no sequence-wise loss",
    "capacity_factor": "it routes without a capacity limit",
}


_REQUIRED = object()  # the default of a setting that config.json must give


def _setting(hf: dict, key: str, fmt: HFFormat, default: Any, kinds: tuple[type, ...], what: str) -> Any:
    """config.json's `key`, refused unless it is one of `kinds`: "8" or 256.0 for a count is a broken file,
    not something to guess at."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"config.json of this {fmt.architecture} lacks {key!r}: give a complete config.json.")
        return default
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        raise ConfigError(
            f"config.json gives {key} = {json.dumps(value)}, which is not {what}: write it as {what} "
            "(without quotes), as transformers writes it."
        )
    return value


def _integer(hf: dict, key: str, fmt: HFFormat, default: Any = _REQUIRED) -> int:
    return _setting(hf, key, fmt, default, (int,), "an integer")


def _number(hf: dict, key: str, fmt: HFFormat, default: float) -> float:
    return float(_setting(hf, key, fmt, default, (int, float), "a number"))


def _flag(hf: dict, key: str, fmt: HFFormat, default: bool) -> bool:
    return _setting(hf, key, fmt, default, (bool,), "true or false")


def _rope_theta(hf: dict, fmt: HFFormat) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(
            f"config.json asks for RoPE scaling {rope_type!r}, which Optimus lacks: use a model without it."
        )
    if "rope_theta" in params:
        return _number(params, "rope_theta", fmt, 10000.0)
    return _number(hf, "rope_theta", fmt, 10000.0)


def _first_k_dense(hf: dict, fmt: HFFormat) -> int:
    """Qwen3-MoE's mlp_only_layers as a count of leading dense layers (the only pattern Optimus builds)."""
    if fmt is not QWEN3_MOE:
        return 0
    dense = hf.get("mlp_only_layers") or []
    step = hf.get("decoder_sparse_step", 1)
    # Compared by repr, so that "0" or true (== 1) in the list is refused like any other pattern.
    leading = isinstance(dense, list) and set(map(repr, dense)) == set(map(repr, range(len(dense))))
    if step != 1 or not leading:
        raise ConfigError(
            f"config.json places dense layers at {dense} (decoder_sparse_step={step}): Optimus builds only leading "
            "dense layers (mlp_only_layers = [0, ..., k-1], decoder_sparse_step = 1)."
        )
    return len(dense)


def _refuse_unsupported(hf: dict, fmt: HFFormat) -> None:
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (Optimus has SwiGLU with silu)")
    if hf.get("attention_bias"):
        problems.append("attention_bias=true")
    if hf.get("clip_qkv") is not None:
        problems.append(f"clip_qkv={hf['clip_qkv']}")
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", fmt.model_type == "mixtral") else None
    if sliding is not None:
        problems.append(f"sliding_window={sliding}")
    head_dim = _integer(hf, "head_dim", fmt, default=None)
    if head_dim is not None and head_dim * _integer(hf, "num_attention_heads", fmt) != _integer(hf, "hidden_size", fmt):
        problems.append(f"head_dim={head_dim} != hidden_size / num_attention_heads")
    if problems:
        raise ConfigError(
            f"this {fmt.architecture} uses {', '.join(problems)}, which Optimus does not compute: "
            "import a model without it."
        )


def model_config_from_hf(hf: dict[str, Any], name: str) -> tuple[ModelConfig, HFFormat]:
    """The ModelConfig that computes what the config.json `hf` describes, and its format."""
    fmt = format_of_hf_config(hf)
    _refuse_unsupported(hf, fmt)
    n_heads = _integer(hf, "num_attention_heads", fmt)
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts (4.x: num_experts), so either counts.
    experts_key = next((k for k in ("num_experts", "num_local_experts") if hf.get(k) is not None), fmt.n_experts_key)
    moe = MoEConfig(
        n_experts=_integer(hf, experts_key, fmt),
        top_k=_integer(hf, "num_experts_per_tok", fmt),
        expert_dim=_integer(hf, fmt.expert_dim_key, fmt),
        n_shared_experts=0,
        router="softmax",
        norm_topk=True if fmt.always_norm_topk else _flag(hf, "norm_topk_prob", fmt, False),
        aux_loss_coef=_number(hf, "router_aux_loss_coef", fmt, fmt.aux_loss_coef),
        **TRANSFORMERS_LOSSES,
    )
    cfg = ModelConfig(
        name=name,
        n_layers=_integer(hf, "num_hidden_layers", fmt),
        dim=_integer(hf, "hidden_size", fmt),
        n_heads=n_heads,
        n_kv_heads=_integer(hf, "num_key_value_heads", fmt, default=n_heads),
        vocab_size=_integer(hf, "vocab_size", fmt),
        # Qwen3-MoE's dense layers' hidden size (in the other formats intermediate_size is the experts').
        ffn_dim=_integer(hf, "intermediate_size", fmt) if fmt is QWEN3_MOE else ModelConfig.ffn_dim,
        first_k_dense=_first_k_dense(hf, fmt),
        rope_theta=_rope_theta(hf, fmt),
        qk_norm=fmt.qk_norm,
        tie_embeddings=_flag(hf, "tie_word_embeddings", fmt, False),
        norm_eps=_number(hf, "rms_norm_eps", fmt, 1e-5),
        init_std=_number(hf, "initializer_range", fmt, 0.02),
        moe=moe,
    )
    validate_model(cfg)
    return cfg, fmt


def loss_sources(hf: dict[str, Any], fmt: HFFormat) -> dict[str, str]:
    """model.moe key -> where model_config_from_hf took its value from, for the comments of an imported recipe."""
    defaults = MoEConfig()
    if "router_aux_loss_coef" in hf:
        aux = "router_aux_loss_coef of the source config.json"
    else:
        aux = f"transformers' default for {fmt.architecture} (the source config.json gives no router_aux_loss_coef)"
    if not hf.get("output_router_logits"):
        aux += "; transformers adds it only with output_router_logits=true, which this config.json leaves off"
    sources = {"aux_loss_coef": aux}
    for key, why in _WHY_TRANSFORMERS.items():
        default = getattr(defaults, key)
        note = "also Optimus's default" if default == TRANSFORMERS_LOSSES[key] else f"Optimus's default: {default}"
        sources[key] = f"as transformers: {why} ({note})"
    sources["bias_update_rate"] = "Optimus's default (read by router=sigmoid only)"
    return sources


def hf_config_from_model(cfg: ModelConfig, fmt: HFFormat, dtype: str = "float32") -> dict[str, Any]:
    """config.json for `cfg` in format `fmt` (checked to hold it by formats.format_for_model)."""
    moe = cfg.moe
    head_dim = cfg.dim // cfg.n_heads
    hf: dict[str, Any] = {
        "architectures": [fmt.architecture],
        "model_type": fmt.model_type,
        "vocab_size": cfg.vocab_size,  # the real vocabulary: the model's padding rows are not exported
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": DEFAULT_MAX_POSITIONS,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,  # transformers 4.x reads this, 5.x rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_dropout": 0.0,
        fmt.n_experts_key: moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe_aux_loss_coef(moe),
        "output_router_logits": False,
        "use_cache": True,
        "dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if fmt.model_type == "mixtral":
        hf.update(intermediate_size=moe.expert_dim, head_dim=head_dim)
        hf.update(sliding_window=None, router_jitter_noise=0.0)
    else:
        hf.update(norm_topk_prob=moe.norm_topk, attention_bias=False)
    if fmt.model_type == "olmoe":
        hf.update(intermediate_size=moe.expert_dim, clip_qkv=None)
    if fmt.model_type == "qwen3_moe":
        hf.update(moe_intermediate_size=moe.expert_dim, intermediate_size=cfg.ffn_dim, head_dim=head_dim)
        hf.update(decoder_sparse_step=1, mlp_only_layers=list(range(cfg.first_k_dense)))
        hf.update(use_sliding_window=False, sliding_window=None)
    return hf
