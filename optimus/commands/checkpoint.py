"""`optimus checkpoint export|import`: its options. Exporting is optimus.checkpoint_export, the Hugging
Face formats optimus.hf."""

from __future__ import annotations

import argparse
import sys

from optimus.checkpoint_export import config_path, consolidated_state, export
from optimus.train.checkpoint import resolve_checkpoint

_EPILOG = """\
examples:
  optimus checkpoint export runs/tiny/checkpoints --out tiny.safetensors          # the latest checkpoint
  optimus checkpoint export runs/tiny/checkpoints/step_000300 --out tiny-300.safetensors
  optimus checkpoint export runs/tiny/checkpoints --format hf --out tiny-hf --dtype bf16   # a HF model directory
  optimus checkpoint import allenai/OLMoE-1B-7B-0924 --out olmoe-ckpt   # then run the `optimus train` line it prints
"""


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
