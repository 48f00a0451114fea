"""Which Hugging Face tensor fills which part of which Optimus tensor.

One list of `Piece`s per (model, format) serves both directions: an HF tensor is
`optimus_tensor[index]` (transposed where `transpose`). Optimus stacks a layer's
experts ([E, D, 2F] gate|up side by side, [E, F, D] down, inputs on the left), HF
stores one [out, in] matrix per expert and projection; Optimus pads the vocabulary
to a multiple of 128, HF holds only the real rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from optimus.config import ModelConfig, qk_norm_mode
from optimus.hf.formats import HFFormat
from optimus.model import moe_layer_ids

# Tensors some HF checkpoints carry that hold nothing to load (recomputed on the fly).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Piece:
    hf_name: str
    optimus_name: str
    index: tuple = ()  # the part of the Optimus tensor (ints and slices); () = all of it
    transpose: bool = False


def _attention(i: int, cfg: ModelConfig) -> Iterator[Piece]:
    hf, ours = f"model.layers.{i}.self_attn", f"layers.{i}.attn"
    for hf_proj, proj in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
        yield Piece(f"{hf}.{hf_proj}.weight", f"{ours}.{proj}.weight")
    if qk_norm_mode(cfg.qk_norm) != "none":
        yield Piece(f"{hf}.q_norm.weight", f"{ours}.q_norm.weight")
        yield Piece(f"{hf}.k_norm.weight", f"{ours}.k_norm.weight")


def _dense_ffn(i: int) -> Iterator[Piece]:
    for hf_proj, proj in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        yield Piece(f"model.layers.{i}.mlp.{hf_proj}.weight", f"layers.{i}.ffn.{proj}.weight")


def _moe(i: int, cfg: ModelConfig, fmt: HFFormat) -> Iterator[Piece]:
    hf, ours = f"model.layers.{i}.{fmt.moe_prefix}", f"layers.{i}.ffn"
    yield Piece(f"{hf}.gate.weight", f"{ours}.router.gate.weight")
    gate, up, down = fmt.expert_names
    f_dim, all_ = cfg.moe.expert_dim, slice(None)
    for e in range(cfg.moe.n_experts):
        yield Piece(f"{hf}.experts.{e}.{gate}.weight", f"{ours}.experts.w13", (e, all_, slice(0, f_dim)), True)
        yield Piece(f"{hf}.experts.{e}.{up}.weight", f"{ours}.experts.w13", (e, all_, slice(f_dim, 2 * f_dim)), True)
        yield Piece(f"{hf}.experts.{e}.{down}.weight", f"{ours}.experts.w2", (e,), True)


def pieces(cfg: ModelConfig, fmt: HFFormat) -> list[Piece]:
    """Every HF tensor of a `fmt` model of shape `cfg`, in the order HF writes them (layer by layer)."""
    vocab = (slice(0, cfg.vocab_size),)
    out = [Piece("model.embed_tokens.weight", "embed.weight", vocab)]
    moe_ids = set(moe_layer_ids(cfg))
    for i in range(cfg.n_layers):
        out.append(Piece(f"model.layers.{i}.input_layernorm.weight", f"layers.{i}.attn_norm.weight"))
        out.extend(_attention(i, cfg))
        out.append(Piece(f"model.layers.{i}.post_attention_layernorm.weight", f"layers.{i}.ffn_norm.weight"))
        out.extend(_moe(i, cfg, fmt) if i in moe_ids else _dense_ffn(i))
    out.append(Piece("model.norm.weight", "norm.weight"))
    if not cfg.tie_embeddings:  # tied: HF stores the embedding once, as Optimus does
        out.append(Piece("lm_head.weight", "lm_head.weight", vocab))
    return out
