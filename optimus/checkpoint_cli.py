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

import argparse
import contextlib
import os
import re
import sys
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

_EPILOG = """\
examples:
  optimus checkpoint export runs/tiny/checkpoints --out tiny.safetensors          # the latest checkpoint
  optimus checkpoint export runs/tiny/checkpoints/step_000300 --out tiny-300.safetensors
  optimus checkpoint export runs/tiny/checkpoints --format hf --out tiny-hf --dtype bf16   # a HF model directory
  optimus checkpoint import allenai/OLMoE-1B-7B-0924 --out olmoe-ckpt   # then run the `optimus train` line it prints
"""


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="optimus checkpoint", description="Work with optimus checkpoints.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{export,import}")
    exp = sub.add_parser(
        "export",
        help="write one consolidated safetensors file of a checkpoint's model",
        description="Consolidate a sharded checkpoint (any layout) into one safetensors file of the full model "
        "(experts stacked as [E, ...]) with its config in the metadata and in a .yaml file of the same name beside it.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exp.add_argument("checkpoint", metavar="CKPT", help="a step directory, or a checkpoint directory (its latest)")
    exp.add_argument("--out", required=True, metavar="PATH", help="the .safetensors file (or, with hf, directory)")
    exp.add_argument(
        "--format", choices=("safetensors", "hf"), default="safetensors",
        help="safetensors: one file, Optimus names; hf: a Hugging Face directory (OLMoE for qk_norm=full, "
        "Qwen3-MoE for head, Mixtral for none)",
    )  # fmt: skip
    exp.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto", help="hf: weights dtype")
    exp.add_argument("--tokenizer", metavar="PATH", help="hf: a tokenizer.json file or directory to include")
    exp.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export at --out (by default it is refused)"
    )
    imp = sub.add_parser(
        "import",
        help="write an Optimus checkpoint and model recipe from a Hugging Face OLMoE/Qwen3-MoE/Mixtral directory",
        description="Convert a Hugging Face model directory into an Optimus checkpoint (a step directory that any "
        "layout loads) with the model recipe that builds it, and print the command that continues pretraining.",
    )
    imp.add_argument(
        "hf_dir", metavar="HF_DIR",
        help="directory with config.json and safetensors weights, or a Hugging Face Hub id (e.g. "
        "allenai/OLMoE-1B-7B-0924: downloaded into, or with HF_HUB_OFFLINE=1 read from, the Hugging Face cache)",
    )  # fmt: skip
    imp.add_argument("--out", required=True, metavar="CKPT", help="new directory for the checkpoint")
    imp.add_argument("--name", help="model recipe name (default: from HF_DIR)")
    imp.add_argument(
        "--overwrite", action="store_true", help="replace an earlier import at --out (by default it is refused)"
    )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "import":
        from optimus.hf.convert import data_keys, import_hf

        done = import_hf(args.hf_dir, args.out, args.name, args.overwrite)
        print(f"Wrote checkpoint {done.checkpoint} and model recipe {done.recipe}.")
        print(f"Training objective (the source's, as transformers computes it): {done.objective}")
        print(f"Continue pretraining with the command below, once filled in ({data_keys(done)}):")
        print(f"  {done.command}")
        return 0
    if args.format == "hf":
        from optimus.hf.convert import export_hf

        path = resolve_checkpoint(args.checkpoint, key="CKPT")
        out = export_hf(path, args.out, consolidated_state, args.dtype, args.tokenizer, args.overwrite)
        print(f"Wrote Hugging Face model directory {out}", file=sys.stdout)
        return 0
    out = export(args.checkpoint, args.out, args.overwrite)
    size = out.stat().st_size / 2**20
    print(f"Wrote {out} ({size:.1f} MiB) and {config_path(out)}", file=sys.stdout)
    return 0
