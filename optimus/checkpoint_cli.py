"""`optimus checkpoint export CKPT --out PATH`: a sharded checkpoint as one consolidated safetensors file.

The file holds the model's full state dict under the model's own parameter names,
with each expert tensor stacked back into [E, ...] over the global expert index,
so `Transformer(cfg.model).load_state_dict(safetensors.torch.load_file(PATH))`
works. The resolved config travels in the file's metadata ("optimus_config", YAML)
and beside it as PATH with the suffix .yaml (model.safetensors -> model.yaml), so exports
of several models can share a folder. One process reads everything (no process group).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from optimus.config import ConfigError
from optimus.train.checkpoint import inspect, resolve_checkpoint

EXPERT_KEY = re.compile(r"^model/(?P<name>.+)/expert_(?P<g>\d+)$")

_EPILOG = """\
examples:
  optimus checkpoint export runs/tiny/checkpoints --out tiny.safetensors          # the latest checkpoint
  optimus checkpoint export runs/tiny/checkpoints/step_000300 --out tiny-300.safetensors
"""


def consolidated_state(path: Path) -> dict[str, torch.Tensor]:
    """The full model state of checkpoint `path`: dense entries as saved, experts stacked into [E, ...]."""
    problem, metadata = inspect(path)
    if problem:
        raise ConfigError(f"checkpoint {path} cannot be read: {problem}; export another checkpoint.")
    saved = metadata.state_dict_metadata
    targets = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in saved.items()
        if key.startswith("model/")
    }
    dcp.load(targets, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
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


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the consolidated model of `checkpoint` (a step dir or a checkpoint root) to `out`; returns out."""
    from safetensors.torch import save_file

    path = resolve_checkpoint(checkpoint, key="CKPT")
    state = consolidated_state(path)
    config_yaml = (path / "config.yaml").read_text() if (path / "config.yaml").is_file() else ""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "optimus_config": config_yaml, "optimus_checkpoint": str(path.resolve())}
    save_file({k: v.contiguous() for k, v in state.items()}, str(out), metadata=metadata)
    if config_yaml:
        config_path(out).write_text(config_yaml)
    return out


def config_path(out: Path) -> Path:
    """Where the config of the export `out` is written: beside it, same name, suffix .yaml."""
    return out.with_suffix(".yaml")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="optimus checkpoint", description="Work with optimus checkpoints.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{export}")
    exp = sub.add_parser(
        "export",
        help="write one consolidated safetensors file of a checkpoint's model",
        description="Consolidate a sharded checkpoint (any layout) into one safetensors file of the full model "
        "(experts stacked as [E, ...]) with its config in the metadata and in a .yaml file of the same name beside it.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exp.add_argument("checkpoint", metavar="CKPT", help="a step directory, or a checkpoint directory (its latest)")
    exp.add_argument("--out", required=True, metavar="PATH", help="the .safetensors file to write")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    out = export(args.checkpoint, args.out)
    size = out.stat().st_size / 2**20
    print(f"Wrote {out} ({size:.1f} MiB) and {config_path(out)}", file=sys.stdout)
    return 0
