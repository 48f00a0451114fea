"""The Mula model family: decoder-only MoE transformers in the OLMoE shape."""

from optimus.model.counts import ParamCounts, count_params, count_params_of_config, flops_per_token
from optimus.model.transformer import Transformer, build_model, moe_layer_ids, padded_vocab_size

__all__ = [
    "ParamCounts",
    "Transformer",
    "build_model",
    "count_params",
    "count_params_of_config",
    "flops_per_token",
    "moe_layer_ids",
    "padded_vocab_size",
]
