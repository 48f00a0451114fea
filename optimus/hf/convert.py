"""Optimus checkpoints <-> Hugging Face directories: what `optimus checkpoint export --format hf` and
`optimus checkpoint import` do (the command line only parses arguments and prints)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from omegaconf import OmegaConf

from optimus.config import ConfigError, ModelConfig, MoEConfig, OptimConfig, OptimusConfig
from optimus.hf.config_map import loss_sources
from optimus.hf.formats import format_of_hf_config
from optimus.hf.hub import hub_snapshot, is_hub_id
from optimus.hf.io import check_save, from_pretrained, read_hf_config, recipe_name, save_state
from optimus.kernels.torch_private import is_view
from optimus.output_dir import check_out_dir, replacing_directory
from optimus.train.checkpoint_checks import hash_files, read_meta
from optimus.train.checkpoint_dirs import META, inspect
from optimus.train.checkpoint_state import model_state
from optimus.train.dcp_warning import no_single_process_warning

DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}


def model_config_of_checkpoint(path: Path) -> ModelConfig:
    """The model that checkpoint `path` holds: the `model` record of its meta.json, taken only once the checks
    that the checkpoint is whole pass (inspect). Its config.yaml is not covered by the checksums, so it is not
    trusted for the model, only held to agree with the record (it travels with a safetensors export)."""
    problem, _ = inspect(path)
    if problem:
        raise ConfigError(f"checkpoint {path} cannot be read: {problem}; export another checkpoint.")
    recorded = _model_config(read_meta(path)["model"], path / META)
    config_file = path / "config.yaml"
    if config_file.exists():
        try:
            saved = yaml.safe_load(config_file.read_text())
        except (OSError, ValueError, yaml.YAMLError) as err:  # ValueError: not UTF-8
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"{config_file} is not readable YAML ({first}): restore it, or export another checkpoint."
            ) from None
        stated = _model_config(saved.get("model") if isinstance(saved, dict) else None, config_file)
        differs = _first_difference(asdict(stated), asdict(recorded), "model.")
        if differs:
            raise ConfigError(
                f"{config_file} says {differs[0]}={differs[1]!r} but the checkpoint was saved with {differs[2]!r} "
                f"(its {META}): restore the config.yaml it was saved with, or export another checkpoint."
            )
    return recorded


def _model_config(record: Any, source: Path) -> ModelConfig:
    if not isinstance(record, dict):
        raise ConfigError(f"{source} has no model settings: restore it, or export another checkpoint.")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), record))
    except (ValueError, KeyError) as err:  # omegaconf's ValidationError, ConfigKeyError
        first = str(err).strip().splitlines()[0]
        raise ConfigError(
            f"the model settings in {source} are not valid ({first}): restore it, or export another checkpoint."
        ) from None


def _first_difference(stated: dict, recorded: dict, prefix: str) -> tuple[str, Any, Any] | None:
    """(dotted key, value in `stated`, value in `recorded`) of the first setting where two model records differ."""
    for key, value in stated.items():
        if isinstance(value, dict):
            found = _first_difference(value, recorded[key], f"{prefix}{key}.")
            if found:
                return found
        elif value != recorded[key]:
            return f"{prefix}{key}", value, recorded[key]
    return None


def export_hf(
    path: Path,
    out: str | Path,
    read_state: Callable[[Path], dict[str, torch.Tensor]],
    dtype: str = "auto",
    tokenizer: Any = None,
    overwrite: bool = False,
) -> Path:
    """Write the model of checkpoint `path` (its full state as `read_state(path)` gives it, checksums checked)
    as a Hugging Face directory `out`. The checkpoint's record of itself is checked first, then the output and
    the tokenizer, all before its weights are read, so a refusal costs little time and writes nothing."""
    cfg = model_config_of_checkpoint(path)
    check_save(cfg, Path(out), tokenizer, overwrite)
    return save_state(read_state(path), cfg, out, tokenizer, DTYPES[dtype], overwrite=overwrite)


@dataclass
class Imported:
    checkpoint: Path  # step directory to give checkpoint.load (absolute)
    recipe: Path  # <checkpoint>/model/<name>.yaml
    tokenizer: Path | None  # <checkpoint>/tokenizer.json when the HF directory had one
    command: str  # continues pretraining from the imported weights (CONTINUED), once its DATA_PATH is filled in
    objective: str  # what the recipe trains, and the overrides for Optimus's defaults


# What _write_checkpoint writes (dcp.save: .metadata and a .distcp file per process): --overwrite replaces a
# checkpoint that holds nothing else.
CHECKPOINT_FILES = (META, "config.yaml", "model/*.yaml", "tokenizer.json", ".metadata", "*.distcp")
DATA_PATH = "DATA_PATH"  # the placeholder of the printed command (see data_keys)
# The optimizer the printed command continues pretraining with: AdamW, which Hugging Face's MoE models (OLMoE,
# Qwen3-MoE, Mixtral) were pretrained with, at the Mula experiments' peak lr (OLMoE's 4e-4), not the default run's
# Muon at the tiny model's 6e-3. Also what the checkpoint's config.yaml records.
CONTINUED = OptimConfig(update="adamw", lr=4e-4)


def import_hf(source: str | Path, out: str | Path, name: str | None = None, overwrite: bool = False) -> Imported:
    """Write the model of `source`, a HF directory or a Hub id (downloaded into, or read from, huggingface_hub's
    cache), as an Optimus checkpoint `out` (a step directory that any layout loads) with the model recipe that
    builds it in `out/model/`; an existing checkpoint there is replaced only with `overwrite`. The output is
    checked before anything is downloaded; the whole directory is written beside `out` and renamed at the end."""
    check_out_dir(Path(out), overwrite, META, "an Optimus checkpoint", CHECKPOINT_FILES)
    out = Path(os.path.abspath(out))  # the printed command works from any directory
    hub_id = str(source) if is_hub_id(source) else None
    hf_dir = hub_snapshot(hub_id) if hub_id else Path(source)
    model, cfg = from_pretrained(hf_dir, name=name or recipe_name(source))
    hf = read_hf_config(hf_dir)
    state = model_state(model)
    del model
    origin = f"{hub_id} (Hugging Face Hub, cached at {hf_dir.resolve()})" if hub_id else str(hf_dir.resolve())
    with replacing_directory(out) as tmp:
        _write_checkpoint(state, cfg, hf_dir, tmp, origin, loss_sources(hf, format_of_hf_config(hf)))
    tokenizer = out / "tokenizer.json" if (out / "tokenizer.json").is_file() else None
    command = shlex.join([
        "optimus", "train", f"hydra.searchpath=[file://{out}]", f"model={cfg.name}", f"checkpoint.load={out}",
        "checkpoint.load_weights_only=true", f"optim.update={CONTINUED.update}", f"optim.lr={CONTINUED.lr}",
        "data=text", f"data.path={DATA_PATH}",
        f"data.tokenizer={tokenizer or 'TOKENIZER'}",
    ])  # fmt: skip
    return Imported(out, out / "model" / f"{cfg.name}.yaml", tokenizer, command, _objective(cfg, hf))


def data_keys(imported: Imported) -> str:
    """What the user fills into the printed command: the data, and the tokenizer where the source had none."""
    tokenizer = imported.tokenizer or "TOKENIZER"
    keys = (
        f"{DATA_PATH}: your .txt/.jsonl/.parquet files or a directory of them; or data=tokens data.path=DIR, "
        f"a directory made by `optimus data prepare --tokenizer {tokenizer}`"
    )
    if imported.tokenizer is None:
        keys += "; TOKENIZER: the tokenizer the model was trained with (a tokenizer.json or a Hugging Face name)"
    return keys


def _objective(cfg: ModelConfig, hf: dict[str, Any]) -> str:
    """The training objective the imported recipe sets (the source's, as transformers computes it), and the
    overrides that change it."""
    moe, defaults = cfg.moe, MoEConfig()
    text = (
        f"cross-entropy + {moe.aux_loss_coef} x load_balancing_loss_func pooled over the MoE layers "
        "(model.moe.aux_loss_layers=pooled, parallel.pp=1 only), no router z-loss"
    )
    if not hf.get("output_router_logits"):
        text += (
            "; with output_router_logits=false, as in its config.json, transformers' own loss leaves the aux loss "
            "out: add model.moe.aux_loss_coef=0 for that"
        )
    return (
        f"{text}; Optimus's defaults instead: model.moe.aux_loss_layers={defaults.aux_loss_layers} "
        f"model.moe.z_loss_coef={defaults.z_loss_coef}."
    )


def annotated_recipe(cfg: ModelConfig, sources: dict[str, str]) -> str:
    """The model recipe of `cfg` as YAML, each model.moe key of `sources` followed by a comment saying where
    its value came from."""
    lines = OmegaConf.to_yaml(OmegaConf.structured(cfg)).splitlines()
    for i, line in enumerate(lines):
        key = line.strip().split(":", 1)[0]
        if line.startswith("  ") and not line.startswith("   ") and key in sources:  # a key of the moe block
            lines[i] = f"{line}  # {sources[key]}"
    return "\n".join(lines) + "\n"


def _write_checkpoint(
    state: dict[str, torch.Tensor], cfg: ModelConfig, hf_dir: Path, out: Path, origin: str, sources: dict[str, str]
) -> None:
    # The per-expert entries are views of [E, ...] stacks, which DCP would copy all at once before writing;
    # copying them here one by one frees each stack as soon as its last view is replaced (peak ~1 model).
    for key, tensor in state.items():
        if is_view(tensor):
            state[key] = tensor.clone()
    # A run that resumes from it (checkpoint.load without load_weights_only) starts at step 0.
    for key in ("trainer/step", "trainer/samples_consumed", "trainer/skipped_in_row"):
        state[key] = torch.tensor(0)
    state["trainer/world"] = torch.tensor(1)
    with no_single_process_warning():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out), single_file_per_rank=True), no_dist=True)
    meta = {
        "step": 0, "world": 1, "dp": 1, "ep": 1, "sharding": "none", "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": asdict(cfg), "imported_from": origin,
        "files": hash_files(out),  # the integrity record a trained checkpoint carries, checked on load and export
    }  # fmt: skip
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(OptimusConfig(model=cfg, optim=CONTINUED))))
    (out / "model").mkdir()
    header = f"# {cfg.name}: imported from {origin} by `optimus checkpoint import`.\n"
    (out / "model" / f"{cfg.name}.yaml").write_text(header + annotated_recipe(cfg, sources))
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copyfile(hf_dir / "tokenizer.json", out / "tokenizer.json")
