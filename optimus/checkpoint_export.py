"""`optimus checkpoint export CKPT --out PATH`: a sharded checkpoint as one consolidated safetensors file.

The file holds the model's full state dict under the model's own parameter names,
with each expert tensor stacked back into [E, ...] over the global expert index,
so `Transformer(cfg.model).load_state_dict(safetensors.torch.load_file(PATH))`
works. The resolved config travels in the file's metadata ("optimus_config", YAML)
and beside it as PATH with the suffix .yaml (model.safetensors -> model.yaml), so exports
of several models can share a folder. One process reads everything (no process group).
Everything is checked before anything is written, both files are written beside their
final names and renamed at the end, and an existing export is replaced only with --overwrite.

`--format hf` writes a Hugging Face directory instead and `optimus checkpoint import`
reads one; both live in optimus.hf (OLMoE, Qwen3-MoE, Mixtral).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from optimus.config import ConfigError
from optimus.data.cache import atomic_path, default_file_mode
from optimus.train.checkpoint_checks import read_meta, verify_files
from optimus.train.checkpoint_dirs import inspect, resolve_checkpoint
from optimus.train.dcp_warning import no_single_process_warning

EXPERT_KEY = re.compile(r"^model/(?P<name>.+)/expert_(?P<g>\d+)$")


def consolidated_state(path: Path) -> dict[str, torch.Tensor]:
    """The full model state of checkpoint `path`: dense entries as saved, experts stacked into [E, ...]."""
    problem, metadata = inspect(path)
    problem = problem or verify_files(path, read_meta(path))
    if problem:
        raise ConfigError(f"checkpoint {path} cannot be read: {problem}; export another checkpoint.")
    saved = metadata.state_dict_metadata
    targets = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in saved.items()
        if key.startswith("model/")
    }
    try:
        with no_single_process_warning():
            dcp.load(targets, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise ConfigError(f"checkpoint {path} cannot be read ({first}): export another checkpoint.") from None
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in targets.items():
        m = EXPERT_KEY.match(key)
        if m:
            experts.setdefault(m["name"], {})[int(m["g"])] = tensor
        else:
            state[key.removeprefix("model/")] = tensor
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ConfigError(f"checkpoint {path} lacks some experts of {name}: export a complete checkpoint.")
        state[name] = torch.stack([by_index[g] for g in range(len(by_index))])  # [E, ...]
    return state


def export(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the consolidated model of `checkpoint` (a step dir or a checkpoint root) to `out`; returns out."""
    from safetensors.torch import save_file

    from optimus.hf.convert import model_config_of_checkpoint

    out = Path(out)
    check_out(out, overwrite)
    path = resolve_checkpoint(checkpoint, key="CKPT")
    model_config_of_checkpoint(path)  # the config.yaml that travels with the weights agrees with what they are
    state = consolidated_state(path)
    config_yaml = (path / "config.yaml").read_text() if (path / "config.yaml").is_file() else ""
    metadata = {"format": "pt", "optimus_config": config_yaml, "optimus_checkpoint": str(path.resolve())}
    # Both files are written under temporary names and renamed only once both are complete (the config first).
    with contextlib.ExitStack() as renamed_on_success:
        weights_tmp = renamed_on_success.enter_context(atomic_path(out))
        if config_yaml:
            renamed_on_success.enter_context(atomic_path(config_path(out))).write_text(config_yaml)
        save_file({k: v.contiguous() for k, v in state.items()}, str(weights_tmp), metadata=metadata)
        os.chmod(weights_tmp, default_file_mode())  # safetensors creates its files 0600
    return out


def check_out(out: Path, overwrite: bool) -> None:
    """--out must name a file that its own config (beside it, as .yaml) will not replace, and neither of the
    two may exist unless --overwrite asks to replace them."""
    if out.is_dir():
        example = out / "model.safetensors"
        raise ConfigError(f"--out {out} is a directory: name the file to write, e.g. --out {example}.")
    if config_path(out) == out:
        raise ConfigError(
            f"--out {out} would be overwritten by the config written beside it as {config_path(out).name}: "
            "name the weights file with the .safetensors suffix."
        )
    if config_path(out).is_dir():
        raise ConfigError(f"{config_path(out)}, where the config of --out {out} goes, is a directory: rename --out.")
    existing = [str(p) for p in (out, config_path(out)) if p.exists()]
    if existing and not overwrite:
        raise ConfigError(
            f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: choose another --out, "
            "or pass --overwrite to replace the earlier export."
        )


def config_path(out: Path) -> Path:
    """Where the config of the export `out` is written: beside it, same name, suffix .yaml."""
    return out.with_suffix(".yaml")
