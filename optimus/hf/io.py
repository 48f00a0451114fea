"""Read and write Hugging Face model directories: config.json, safetensors (sharded with an index), tokenizer.

Only `safetensors` is needed, not `transformers`. Loading builds the model on the meta
device, allocates it once, and fills it one tensor at a time from one shard file at a
time, so the peak stays near one copy of the weights; saving converts and writes one
shard at a time. A directory is written whole or not at all: everything is checked
first (format, output, tokenizer), then written into a new sibling that is renamed into
place at the end, and an existing model directory is replaced only with `overwrite`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from optimus.config import ConfigError, ModelConfig
from optimus.hf.config_map import hf_config_from_model, model_config_from_hf
from optimus.hf.formats import HFFormat, format_for_model
from optimus.hf.weight_map import IGNORED_SUFFIXES, Piece, pieces
from optimus.model import Transformer
from optimus.output_dir import check_out_dir, replacing_directory

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json",
)  # fmt: skip
# What save_state writes (write_tokenizer: a transformers tokenizer's save_pretrained adds its chat template):
# --overwrite replaces a directory that holds nothing else.
EXPORTED_FILES = (CONFIG, "*.safetensors", INDEX_FILE, *TOKENIZER_FILES, "chat_template.jinja")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def recipe_name(path: str | Path) -> str:
    """A model name from a directory name: lower case, only letters, digits, '.', '_' and '-'."""
    return re.sub(r"[^a-z0-9_.-]+", "-", Path(path).resolve().name.lower()).strip("-") or "imported"


def read_hf_config(path: Path) -> dict[str, Any]:
    if not (path / CONFIG).is_file():
        raise ConfigError(f"{path} holds no {CONFIG}: give a Hugging Face model directory.")
    try:
        hf = json.loads((path / CONFIG).read_text())
    except ValueError as err:  # JSONDecodeError, or UnicodeDecodeError for a binary file
        raise ConfigError(f"{path / CONFIG} is not valid JSON ({err}): repair or replace it.") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path / CONFIG} holds a {type(hf).__name__}, not a JSON object: repair or replace it.")
    return hf


def _indexed_files(index: Path) -> list[str]:
    """The file names the weight_map of a model.safetensors.index.json names."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = set(weight_map.values())
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, no weight_map, not a mapping
        names = None
    if not names or not all(isinstance(name, str) for name in names):
        raise ConfigError(
            f"{index} is not a valid index (a JSON object whose weight_map maps tensor names to file names): "
            "download it again, or delete it if the directory holds a single model.safetensors."
        )
    return sorted(names)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: those its index names, or its one model.safetensors."""
    if (path / INDEX_FILE).is_file():
        files = [path / name for name in _indexed_files(path / INDEX_FILE)]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        raise ConfigError(
            f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}: give a directory with safetensors weights."
        )
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"{path} lacks the weight files {', '.join(missing)} that its index names: download them.")
    return files


def _fill(target: torch.Tensor, piece: Piece, tensor: torch.Tensor) -> None:
    part = target[piece.index]
    source = tensor.T if piece.transpose else tensor
    if tuple(part.shape) != tuple(source.shape):
        expected = tuple(part.T.shape if piece.transpose else part.shape)
        raise ConfigError(
            f"{piece.hf_name} has shape {tuple(tensor.shape)} but config.json implies {expected}: "
            "the weights do not belong to this config.json."
        )
    part.copy_(source)


@torch.no_grad()
def load_weights(model: Transformer, cfg: ModelConfig, fmt, path: Path) -> None:
    """Fill `model` from the safetensors files of `path`, one file and one tensor at a time."""
    from safetensors import SafetensorError, safe_open

    state = model.state_dict()
    by_hf_name = {p.hf_name: p for p in pieces(cfg, fmt)}
    seen, unexpected = set(), []
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    piece = by_hf_name.get(key)
                    if piece is None:
                        tied_copy = cfg.tie_embeddings and key == "lm_head.weight"
                        if not (tied_copy or key.endswith(IGNORED_SUFFIXES)):
                            unexpected.append(key)
                        continue
                    _fill(state[piece.optimus_name], piece, f.get_tensor(key))
                    seen.add(key)
        except SafetensorError as err:  # a truncated or garbled file
            raise ConfigError(
                f"{file} is not a readable safetensors file ({err}): download it again or replace it."
            ) from None
    missing = [name for name in by_hf_name if name not in seen]
    if missing or unexpected:
        what = f"lacks {len(missing)} tensors (first: {missing[0]})" if missing else ""
        what += (" and " if missing and unexpected else "") + (
            f"has {len(unexpected)} tensors this format does not define (first: {unexpected[0]})" if unexpected else ""
        )
        raise ConfigError(f"{path} {what}: the weights do not match its config.json.")


def from_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, kernels: str = "auto", name: str | None = None
) -> tuple[Transformer, ModelConfig]:
    """An Optimus model (and its config) from an OLMoE, Qwen3-MoE or Mixtral directory, on the CPU."""
    path = Path(path)
    cfg, fmt = model_config_from_hf(read_hf_config(path), name or recipe_name(path))
    with torch.device("meta"):
        model = Transformer(cfg, kernels).to(dtype)
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:  # to_empty gives each module its own tensor, which unties them
        model.lm_head.weight = model.embed.weight
    with torch.no_grad():
        for tensor in model.state_dict().values():  # padding rows of the vocabulary and router biases stay 0
            tensor.zero_()
    load_weights(model, cfg, fmt, path)
    return model, cfg


def _hf_tensor(state: dict[str, torch.Tensor], piece: Piece, dtype: torch.dtype | None) -> torch.Tensor:
    """A fresh contiguous tensor (safetensors refuses tensors that share memory)."""
    part = state[piece.optimus_name][piece.index]
    part = part.T if piece.transpose else part
    return torch.empty(part.shape, dtype=dtype or part.dtype).copy_(part)


def _shards(plan: list[Piece], state: dict[str, torch.Tensor], dtype, max_bytes: int) -> list[list[Piece]]:
    shards: list[list[Piece]] = [[]]
    size = 0
    for piece in plan:
        part = state[piece.optimus_name][piece.index]
        nbytes = part.numel() * (dtype or part.dtype).itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(piece)
        size += nbytes
    return shards


def save_state(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    path: str | Path,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write the full model state `state` (Optimus names, experts stacked [E, ...]) as a HF directory `path`;
    an existing model directory there is replaced only with `overwrite`."""
    path = Path(path)
    fmt, tokenizer = check_save(cfg, path, tokenizer, overwrite)
    with replacing_directory(path) as tmp:
        _write_model(state, cfg, fmt, tmp, tokenizer, dtype, max_shard_bytes)
    return path


def check_save(cfg: ModelConfig, path: Path, tokenizer: Any, overwrite: bool) -> tuple[HFFormat, Any]:
    """What save_state checks before it writes anything: that a format holds the model, that `path` may be
    written, and that the tokenizer exists; returns the format and the tokenizer as write_tokenizer takes it."""
    fmt = format_for_model(cfg)
    check_out_dir(path, overwrite, CONFIG, "a Hugging Face model directory", EXPORTED_FILES)
    return fmt, checked_tokenizer(tokenizer)


def _write_model(state, cfg: ModelConfig, fmt: HFFormat, path: Path, tokenizer, dtype, max_shard_bytes) -> None:
    from safetensors.torch import save_file

    plan = pieces(cfg, fmt)
    shards = _shards(plan, state, dtype, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for shard, name in zip(shards, names):
        tensors = {p.hf_name: _hf_tensor(state, p, dtype) for p in shard}
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    out_dtype = dtype or state[plan[0].optimus_name].dtype
    hf = hf_config_from_model(cfg, fmt, DTYPE_NAMES.get(out_dtype, "float32"))
    (path / CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer is not None:
        write_tokenizer(tokenizer, path)


def save_pretrained(
    model: Transformer,
    model_cfg: ModelConfig,
    path: str | Path,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write `model` (all of its experts on this process) as a HF directory of the format its config implies:
    qk_norm=full -> OLMoE, head -> Qwen3-MoE, none -> Mixtral. `tokenizer`: a tokenizers.Tokenizer, a
    tokenizer.json file, a directory of tokenizer files, or a transformers tokenizer. An existing model
    directory at `path` is replaced only with `overwrite=True`."""
    if any(moe.experts.n_experts != model_cfg.moe.n_experts for moe in model.moe_layers):
        raise ConfigError(
            "this model holds only its rank's experts: save from a consolidated model (optimus checkpoint export)."
        )
    return save_state(model.state_dict(), model_cfg, path, tokenizer, dtype, max_shard_bytes, overwrite)


def checked_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` checked before anything is written: an object as given, a path as {name in the model
    directory: file to copy there}."""
    if tokenizer is None or hasattr(tokenizer, "save_pretrained") or hasattr(tokenizer, "to_str"):
        return tokenizer
    source = Path(tokenizer)
    if source.is_dir():
        found = {n: source / n for n in TOKENIZER_FILES if (source / n).is_file()}
        if not found:
            raise ConfigError(
                f"{source} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): "
                "give a tokenizer.json file or a directory that holds one."
            )
        return found
    if not source.is_file():
        raise ConfigError(f"tokenizer {source} does not exist: give a tokenizer.json file or a directory.")
    try:
        json.loads(source.read_text())
    except ValueError:
        raise ConfigError(
            f"tokenizer {source} is not a tokenizer.json (not valid JSON): give a tokenizer.json file or a directory."
        ) from None
    return {"tokenizer.json": source}


def write_tokenizer(tokenizer: Any, path: Path) -> None:
    """Put the tokenizer files (as checked_tokenizer returns them) beside the weights, as
    AutoTokenizer.from_pretrained(path) expects them."""
    if hasattr(tokenizer, "save_pretrained"):  # a transformers tokenizer
        tokenizer.save_pretrained(str(path))
        return
    if hasattr(tokenizer, "to_str"):  # a tokenizers.Tokenizer
        tokenizer.save(str(path / "tokenizer.json"))
    else:
        for name, source in tokenizer.items():
            shutil.copyfile(source, path / name)
    if not (path / "tokenizer_config.json").is_file():  # what lets AutoTokenizer load a bare tokenizer.json
        (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")
