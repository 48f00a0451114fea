"""What a checkpoint promises about itself, checked before it is trusted.

Two records go into a checkpoint's meta.json when it is published:

    files     {name: sha256} of every file DCP wrote (.metadata and one .distcp per rank);
              the ranks hash in parallel, each a share of the files, and verify the same way on load
    run       the settings a resumed run must share with the run that saved it (the data's content,
              tokenizer, sequence length, global batch, seed); the model's shape is in `model`, as before

Learning rate, step count and everything else may change between a save and a resume.
Only a complete record is trusted (untrusted_record): a meta.json that is unreadable, lacks
`files` or a checksum of one of the files, or lacks `model` (and, for a resume, `run`) cannot
vouch for the checkpoint, which is then treated like a corrupt one.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from optimus.config import ModelConfig, MoEConfig, OptimusConfig, moe_aux_loss_coef, qk_norm_mode
from optimus.data.cache import sha256_file

# Settings that define the sample stream: changing one mid-run silently trains on other data. The data itself
# is identified by its tokens' content (DataBundle.identity), not by data.path or data.mix: the same tokens under
# another path (or the same path given relative) resume, and tokens re-made in place are refused.
# optim.update too: Muon's state is not AdamW's (the first moment holds Muon's momentum, the second is unused).
RUN_KEYS = (
    "train.seq_len", "train.global_batch", "train.seed", "data.name",
    "data.text_field", "data.hf_split", "data.hf_config", "data.val_fraction", "data.max_chars", "optim.update",
)  # fmt: skip
# What checkpoints saved before a RUN_KEYS setting existed were saved with (they are held to it).
RUN_KEYS_BEFORE = {"optim.update": "adamw"}
# Keys that change the tensors' shapes: a checkpoint's weights cannot go into a model that differs in one.
SHAPE_KEYS = (
    "n_layers", "dim", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "first_k_dense", "tie_embeddings",
    "moe.n_experts", "moe.expert_dim", "moe.n_shared_experts",
)  # fmt: skip
# ... and those that change what the same tensors compute: a resumed run keeps them too.
ARCH_KEYS = (
    *SHAPE_KEYS, "qk_norm", "rope_theta", "norm_eps", "moe.top_k", "moe.router", "moe.norm_topk", "moe.n_groups",
    "moe.topk_groups", "moe.routed_scaling_factor",
)  # fmt: skip
SKIP_FILES = ("meta.json", "config.yaml")  # written after the hashes are taken
# Model keys a start from a checkpoint's weights does not compare: a label, and the initialisation they replace.
UNCOMPARED_MODEL_KEYS = ("name", "init_std", "embed_init_std")


def _get(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else getattr(tree, part, None)
    return tree


def _plain(value: Any) -> Any:
    """The value as it reads back from JSON (tuples become lists, ListConfig a list)."""
    return json.loads(json.dumps(value, default=lambda v: list(v) if hasattr(v, "__iter__") else str(v)))


def run_identity(cfg: OptimusConfig, data_identity: dict[str, Any] | None) -> dict[str, Any]:
    """The `run` record of meta.json: the RUN_KEYS settings and `data_identity`, what identifies the data the
    run reads (DataBundle.identity: data.tokens, data.mix.weights, tokenizer)."""
    record = {key: _plain(_get(cfg, key)) for key in RUN_KEYS}
    return {**record, **_plain(data_identity or {})}


def changed_setting(
    meta: dict, cfg: OptimusConfig, data_identity: dict[str, Any] | None, weights_only: bool
) -> tuple[str, Any, Any] | None:
    """(key, saved value, value now) of the first setting that differs from checkpoint `meta`, or None.
    Checkpoints that did not record a setting are not held to it."""
    model_keys = SHAPE_KEYS if weights_only else ARCH_KEYS
    pairs = [(f"model.{k}", _get(meta.get("model") or {}, k), _get(cfg.model, k)) for k in model_keys]
    if not weights_only:
        saved_run = meta.get("run") or {}
        now = run_identity(cfg, data_identity)
        pairs += [(k, saved_run.get(k, RUN_KEYS_BEFORE.get(k, now[k])), now[k]) for k in now]
    for key, saved, current in pairs:
        if saved is not None and current is not None and _plain(saved) != _plain(current):
            return key, saved, current
    return None


def _settings(model: dict) -> dict[str, Any]:
    """A model record as {dotted key: value as it computes}: an old boolean qk_norm as the mode it meant, and
    aux_loss_coef null as the coefficient it stands for."""
    flat = {}
    for key, value in model.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in _settings(value).items()})
        else:
            flat[key] = qk_norm_mode(value) if key == "qk_norm" else _plain(value)
    if "router" in flat and "aux_loss_coef" in flat:  # the moe record
        flat["aux_loss_coef"] = moe_aux_loss_coef(MoEConfig(router=flat["router"], aux_loss_coef=flat["aux_loss_coef"]))
    return flat


def model_differences(saved: dict, model: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(model.KEY, saved value, value now) of each model setting that differs from a checkpoint's `model`
    record `saved`, in ModelConfig's order; settings the record lacks, and UNCOMPARED_MODEL_KEYS, are not."""
    recorded, now = _settings(saved), _settings(asdict(model))
    return [
        (f"model.{key}", recorded[key], value)
        for key, value in now.items()
        if key in recorded and key not in UNCOMPARED_MODEL_KEYS and recorded[key] != value
    ]


def meaning_changes(differences: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """Those of `differences` (model_differences) that change what the same weights compute (ARCH_KEYS)."""
    return [d for d in differences if d[0].removeprefix("model.") in ARCH_KEYS]


def hash_files(directory: Path, rank: int = 0, world: int = 1) -> dict[str, str]:
    """sha256 of this rank's share (every world-th file, by name) of the files DCP wrote into `directory`."""
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in SKIP_FILES)
    return {name: sha256_file(directory / name) for name in files[rank::world]}


def verify_files(directory: Path, meta: dict, rank: int = 0, world: int = 1) -> str | None:
    """Why this rank's share of the files listed in `meta["files"]` does not match, or None."""
    listed = sorted((meta.get("files") or {}).items())
    for name, digest in listed[rank::world]:
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        if sha256_file(path) != digest:
            return f"{path} does not match the checksum in its meta.json (the file is corrupt)"
    return None


def untrusted_record(directory: Path, written: set[str], resume: bool = False) -> str | None:
    """Why the meta.json of `directory` cannot vouch for the files DCP `written` there, or None: it must
    parse, hold a checksum of each of them and the model's settings (with `resume`, the run's as well)."""
    path = directory / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
        return f"{path} is unreadable ({type(err).__name__}), so nothing vouches for its files"
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        return f'{path} has no "files" checksums, so nothing vouches for its files'
    unlisted = sorted(written - meta["files"].keys())
    if unlisted:
        return f"{path} has no checksum of {unlisted[0]}, so nothing vouches for that file"
    for record in ("model", "run") if resume else ("model",):
        if not isinstance(meta.get(record), dict):
            return f'{path} has no "{record}" record of the settings it was saved with'
    return None


def read_meta(directory: Path) -> dict:
    """meta.json of a checkpoint ({} when unreadable: inspect() reports that)."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}
