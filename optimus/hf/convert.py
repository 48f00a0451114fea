"""Optimus checkpoints <-> Hugging Face directories: what `optimus checkpoint export --format hf` and
`optimus checkpoint import` do (the command line only parses arguments and prints)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from optimus.config import ConfigError, ModelConfig, OptimusConfig
from optimus.hf.io import from_pretrained, save_state
from optimus.train.checkpoint import META
from optimus.train.checkpoint_state import model_state
from optimus.train.dcp_warning import no_single_process_warning

DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}


def model_config_of_checkpoint(path: Path) -> ModelConfig:
    """The model settings a checkpoint was saved with (its config.yaml)."""
    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(f"checkpoint {path} has no config.yaml: export a checkpoint that Optimus saved.")
    saved = OmegaConf.load(config_file)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved.get("model", {})))


def export_hf(
    path: Path, state: dict[str, torch.Tensor], out: str | Path, dtype: str = "auto", tokenizer: Any = None
) -> Path:
    """Write the consolidated model `state` of checkpoint `path` as a Hugging Face directory `out`."""
    return save_state(state, model_config_of_checkpoint(path), out, tokenizer, DTYPES[dtype])


@dataclass
class Imported:
    checkpoint: Path  # step directory to give checkpoint.load
    recipe: Path  # <checkpoint>/model/<name>.yaml
    tokenizer: Path | None  # <checkpoint>/tokenizer.json when the HF directory had one
    command: str  # continues pretraining from the imported weights


def import_hf(hf_dir: str | Path, out: str | Path, name: str | None = None) -> Imported:
    """Write the model of HF directory `hf_dir` as an Optimus checkpoint `out` (a step directory that any
    layout loads) with the model recipe that builds it in `out/model/`."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty: choose a new --out directory or remove it.")
    model, cfg = from_pretrained(hf_dir, name=name)
    out.mkdir(parents=True, exist_ok=True)
    state = model_state(model)
    del model
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
    meta = {
        "step": 0, "world": 1, "dp": 1, "ep": 1, "sharding": "none", "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": asdict(cfg), "imported_from": str(Path(hf_dir).resolve()),
    }  # fmt: skip
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(OptimusConfig(model=cfg))))
    recipe = out / "model" / f"{cfg.name}.yaml"
    recipe.parent.mkdir()
    header = f"# {cfg.name}: imported from {Path(hf_dir).resolve()} by `optimus checkpoint import`.\n"
    recipe.write_text(header + OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    tokenizer = None
    if (Path(hf_dir) / "tokenizer.json").is_file():
        tokenizer = out / "tokenizer.json"
        shutil.copyfile(Path(hf_dir) / "tokenizer.json", tokenizer)
    command = (
        f"optimus train hydra.searchpath=[file://{out.resolve()}] model={cfg.name} "
        f"checkpoint.load={out} checkpoint.load_weights_only=true"
        + (f" data.tokenizer={tokenizer}" if tokenizer else "")
    )
    return Imported(out, recipe, tokenizer, command)
