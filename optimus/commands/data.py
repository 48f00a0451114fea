"""`optimus data ...`: prepare token shards and train tokenizers.

The `optimus` command calls `main(sys.argv[2:])`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from optimus.config import ConfigError
from optimus.data.errors import DataError

_EPILOG_PREPARE = """\
examples:
  optimus data prepare --input corpus/ --output data/corpus-tok --tokenizer data/tok.json --num-proc 8
  optimus data prepare --input a.jsonl.zst b.parquet --output data/ab --tokenizer gpt2 --text-field content
then train on it with:  optimus train data=tokens data.path=data/corpus-tok
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="optimus data", description="Prepare training data for optimus.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{prepare,tokenizer}")

    prep = sub.add_parser(
        "prepare",
        help="tokenise a corpus into token shards for data=tokens",
        description=(
            "Tokenise .txt, .jsonl(.gz|.zst) or .parquet files, directories of them, a saved `datasets` directory, "
            "or a `datasets` hub name, into flat token shards (uint16 or uint32) with document ends and a meta.json "
            "(tokenizer identity, counts, per-shard checksums). Each document is followed by the end-of-text token. "
            "Re-running the same job is a no-op; meta.json is written last, so an interrupted run is never trusted."
        ),
        epilog=_EPILOG_PREPARE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.add_argument("--input", nargs="+", required=True, metavar="PATH_OR_DATASET", help="inputs, read in order")
    prep.add_argument("--output", required=True, metavar="DIR", help="directory for the shards and meta.json")
    prep.add_argument(
        "--tokenizer", required=True, metavar="NAME_OR_PATH", help="tokenizer.json file, or a Hugging Face name"
    )
    prep.add_argument("--num-proc", type=int, default=1, metavar="N", help="tokenising processes (default 1)")
    prep.add_argument("--text-field", default="text", help="JSONL field / Parquet or dataset column (default text)")
    prep.add_argument("--split", default="train", help="split of a `datasets` input (default train)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard (default 2**28)")
    prep.add_argument("--overwrite", action="store_true", help="replace an output made from a different input")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")

    tok = sub.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer",
        description="Train a byte-level BPE tokenizer (with <|endoftext|> as id 0) on the given inputs and save it "
        "as a tokenizers JSON file, usable as --tokenizer for prepare and as data.tokenizer.",
    )
    tok.add_argument("--input", nargs="+", required=True, metavar="PATH_OR_DATASET", help="training text")
    tok.add_argument("--vocab-size", type=int, required=True, metavar="N", help="vocabulary size (>= 257)")
    tok.add_argument("--output", required=True, metavar="PATH", help="where to write tokenizer.json")
    tok.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    tok.add_argument("--text-field", default="text", help="JSONL field / Parquet or dataset column (default text)")
    tok.add_argument("--split", default="train", help="split of a `datasets` input (default train)")
    return p


def _cmd_prepare(args: argparse.Namespace) -> int:
    from optimus.data.prepare import prepare

    meta = prepare(
        args.input,
        args.output,
        args.tokenizer,
        num_proc=args.num_proc,
        text_field=args.text_field,
        split=args.split,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        shard_tokens=args.shard_tokens,
    )
    summary = {k: meta[k] for k in ("n_docs", "n_tokens", "dtype")}
    print(f"{args.output}: {json.dumps(summary)} in {len(meta['shards'])} shard(s)")
    return 0


def _cmd_tokenizer(args: argparse.Namespace) -> int:
    from optimus.data.cache import atomic_path, write_error
    from optimus.data.prepare import input_docs
    from optimus.data.tokenizer import describe, train_bpe

    out = Path(args.output).expanduser()
    _check_tokenizer_output(out, args.input, args.overwrite)
    docs = list(input_docs(args.input, args.text_field, args.split))
    if not docs:
        raise DataError(f"--input {' '.join(args.input)} has no non-empty documents: point it at files with text.")
    tok = train_bpe(docs, args.vocab_size)
    info = describe(tok, args.output)
    try:
        with atomic_path(out) as tmp:  # written from Python, so a full disk is an OSError like every other write
            tmp.write_text(tok.to_str(pretty=True), encoding="utf-8")
    except OSError as err:
        raise write_error(str(out), err, "choose another --output") from None
    print(f"{out}: vocab {info.vocab_size}, eos id {info.eos_id}, id {info.id}")
    return 0


def _check_tokenizer_output(out: Path, inputs: list[str], overwrite: bool) -> None:
    """Refuse, before reading or training anything, an --output that is a directory, one of the inputs, or
    (without --overwrite) an existing file."""
    from optimus.data.prepare import local_input_files

    if out.is_dir():
        raise DataError(f"--output {out} is a directory: give a file path for the tokenizer, e.g. {out / 'tok.json'}.")
    if out.exists() and any(out.samefile(p) for p in local_input_files(inputs)):
        raise DataError(f"--output {out} is one of the --input files: choose another --output for the tokenizer.")
    if out.exists() and not overwrite:
        raise DataError(f"--output {out} already exists: pass --overwrite to replace it, or choose another --output.")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("OPTIMUS_LOG_LEVEL", "INFO"), format="%(message)s")
    try:
        return _cmd_prepare(args) if args.command == "prepare" else _cmd_tokenizer(args)
    except (DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
