"""The Mula model family: decoder-only MoE transformers in the OLMoE shape."""

from optimus.model.counts import ParamCounts, count_params, count_params_of_config, flops_per_token
from optimus.model.transformer import ModelOutput, Transformer, padded_vocab_size

__all__ = [
    "ModelOutput",
    "ParamCounts",
    "Transformer",
    "count_params",
    "count_params_of_config",
    "flops_per_token",
    "padded_vocab_size",
]
