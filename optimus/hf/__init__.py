"""Hugging Face interop: OLMoE, Qwen3-MoE and Mixtral directories in and out of Optimus.

    model, cfg = from_pretrained("OLMoE-1B-7B")          # -> (Transformer, ModelConfig), CPU, fp32
    save_pretrained(model, cfg, "out", tokenizer=tok)   # format from cfg.qk_norm: full/head/none

Needs only `safetensors`; `transformers` (the `hf` extra) is used by the tests as the reference.
"""

from optimus.hf.formats import FORMATS, MIXTRAL, OLMOE, QWEN3_MOE, HFFormat, format_for_model
from optimus.hf.io import from_pretrained, save_pretrained, save_state

__all__ = [
    "FORMATS",
    "MIXTRAL",
    "OLMOE",
    "QWEN3_MOE",
    "HFFormat",
    "format_for_model",
    "from_pretrained",
    "save_pretrained",
    "save_state",
]
