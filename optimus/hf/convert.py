"""Optimus checkpoints <-> Hugging Face directories: what `optimus checkpoint export --format hf` and
`optimus checkpoint import` do (the command line only parses arguments and prints)."""

from __future__ import annotations

import json
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

from optimus.config import ConfigError, ModelConfig, OptimusConfig
from optimus.hf.io import check_out_dir, check_save, from_pretrained, replacing_directory, save_state
from optimus.train.checkpoint import META, inspect
from optimus.train.checkpoint_checks import hash_files, read_meta
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
    checkpoint: Path  # step directory to give checkpoint.load
    recipe: Path  # <checkpoint>/model/<name>.yaml
    tokenizer: Path | None  # <checkpoint>/tokenizer.json when the HF directory had one
    command: str  # continues pretraining from the imported weights


def import_hf(hf_dir: str | Path, out: str | Path, name: str | None = None, overwrite: bool = False) -> Imported:
    """Write the model of HF directory `hf_dir` as an Optimus checkpoint `out` (a step directory that any
    layout loads) with the model recipe that builds it in `out/model/`; an existing checkpoint there is
    replaced only with `overwrite`. The whole directory is written beside `out` and renamed at the end."""
    out, hf_dir = Path(out), Path(hf_dir)
    check_out_dir(out, overwrite, META, "an Optimus checkpoint")
    model, cfg = from_pretrained(hf_dir, name=name)
    state = model_state(model)
    del model
    with replacing_directory(out) as tmp:
        _write_checkpoint(state, cfg, hf_dir, tmp)
    tokenizer = out / "tokenizer.json" if (out / "tokenizer.json").is_file() else None
    command = (
        f"optimus train hydra.searchpath=[file://{out.resolve()}] model={cfg.name} "
        f"checkpoint.load={out} checkpoint.load_weights_only=true"
        + (f" data.tokenizer={tokenizer}" if tokenizer else "")
    )
    return Imported(out, out / "model" / f"{cfg.name}.yaml", tokenizer, command)


def _write_checkpoint(state: dict[str, torch.Tensor], cfg: ModelConfig, hf_dir: Path, out: Path) -> None:
    # The per-expert entries are views of [E, ...] stacks, which DCP would copy all at once before writing;
    # copying them here one by one frees each stack as soon as its last view is replaced (peak ~1 model).
    for key, tensor in state.items():
        if tensor._is_view():
            state[key] = tensor.clone()
    # A run that resumes from it (checkpoint.load without load_weights_only) starts at step 0.
    for key in ("trainer/step", "trainer/samples_consumed", "trainer/skipped_in_row"):
        state[key] = torch.tensor(0)
    state["trainer/world"] = torch.tensor(1)
    with no_single_process_warning():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out), single_file_per_rank=True), no_dist=True)
    source = hf_dir.resolve()
    meta = {
        "step": 0, "world": 1, "dp": 1, "ep": 1, "sharding": "none", "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": asdict(cfg), "imported_from": str(source),
        "files": hash_files(out),  # the integrity record a trained checkpoint carries, checked on load and export
    }  # fmt: skip
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(OptimusConfig(model=cfg))))
    (out / "model").mkdir()
    header = f"# {cfg.name}: imported from {source} by `optimus checkpoint import`.\n"
    (out / "model" / f"{cfg.name}.yaml").write_text(header + OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copyfile(hf_dir / "tokenizer.json", out / "tokenizer.json")
