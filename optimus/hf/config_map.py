"""config.json of a Hugging Face MoE model <-> Optimus ModelConfig.

Reading refuses what Optimus does not compute the same way (another activation, RoPE
scaling, attention biases, sliding windows, a head size other than dim / n_heads), so
an imported model either gives the same logits or is not imported at all.
"""

from __future__ import annotations

from typing import Any

from optimus.config import ConfigError, ModelConfig, MoEConfig, moe_aux_loss_coef, validate_model
from optimus.hf.formats import QWEN3_MOE, HFFormat, format_of_hf_config

DEFAULT_MAX_POSITIONS = 4096  # Optimus has no position limit (RoPE is computed for any length)


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(
            f"config.json asks for RoPE scaling {rope_type!r}, which Optimus lacks: use a model without it."
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _first_k_dense(hf: dict, fmt: HFFormat, n_layers: int) -> int:
    """Qwen3-MoE's mlp_only_layers as a count of leading dense layers (the only pattern Optimus builds)."""
    if fmt is not QWEN3_MOE:
        return 0
    dense = sorted(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    if step != 1 or dense != list(range(len(dense))):
        raise ConfigError(
            f"config.json places dense layers at {dense} (decoder_sparse_step={step}): Optimus builds only leading "
            "dense layers (mlp_only_layers = [0, ..., k-1], decoder_sparse_step = 1)."
        )
    return len(dense) if dense else 0


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
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
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
    try:
        n_layers = hf["num_hidden_layers"]
        first_k_dense = _first_k_dense(hf, fmt, n_layers)
        moe = MoEConfig(
            n_experts=hf.get("num_experts", hf.get("num_local_experts")),
            top_k=hf["num_experts_per_tok"],
            expert_dim=hf[fmt.expert_dim_key],
            n_shared_experts=0,
            router="softmax",
            norm_topk=True if fmt.always_norm_topk else bool(hf.get("norm_topk_prob", False)),
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)),
        )
        cfg = ModelConfig(
            name=name,
            n_layers=n_layers,
            dim=hf["hidden_size"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            vocab_size=hf["vocab_size"],
            # Qwen3-MoE's dense layers' hidden size (in the other formats intermediate_size is the experts').
            ffn_dim=hf["intermediate_size"] if fmt is QWEN3_MOE else ModelConfig.ffn_dim,
            first_k_dense=first_k_dense,
            rope_theta=_rope_theta(hf),
            qk_norm=fmt.qk_norm,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            init_std=float(hf.get("initializer_range", 0.02)),
            moe=moe,
        )
    except KeyError as err:
        raise ConfigError(f"config.json of this {fmt.architecture} lacks {err}: give a complete config.json.") from None
    validate_model(cfg)
    return cfg, fmt


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
        hf.update(num_local_experts=moe.n_experts, intermediate_size=moe.expert_dim, head_dim=head_dim)
        hf.update(sliding_window=None, router_jitter_noise=0.0)
    else:
        hf.update(num_experts=moe.n_experts, norm_topk_prob=moe.norm_topk, attention_bias=False)
    if fmt.model_type == "olmoe":
        hf.update(intermediate_size=moe.expert_dim, clip_qkv=None)
    if fmt.model_type == "qwen3_moe":
        hf.update(moe_intermediate_size=moe.expert_dim, intermediate_size=cfg.ffn_dim, head_dim=head_dim)
        hf.update(decoder_sparse_step=1, mlp_only_layers=list(range(cfg.first_k_dense)))
        hf.update(use_sliding_window=False, sliding_window=None)
    return hf
