"""Data pipeline throughput: `prepare` (MB/s, tokens/s at 1 and 2 processes) and BatchLoader (samples/s).

    python benchmarks/data.py [--chars 16000000] [--seq-len 2048]

The corpus is the built-in stdlib text written out as JSONL. Results go to
benchmarks/results/data_cpu.json. The loader figure is compared with what the
tiny model consumes (a few thousand tokens/s on a 2-core CPU; pass --model-tokens-per-s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from optimus.config import DataConfig
from optimus.data import BatchLoader, build_data, prepare, train_bpe
from optimus.data.sources import stdlib_docs


def bench_prepare(jsonl: Path, tok: Path, work: Path, num_proc: int, n_bytes: int) -> dict:
    out = work / f"prep-{num_proc}"
    t0 = time.perf_counter()
    meta = prepare([str(jsonl)], out, str(tok), num_proc=num_proc, progress=False)
    dt = time.perf_counter() - t0
    return {"num_proc": num_proc, "seconds": dt, "MB_per_s": n_bytes / dt / 1e6, "tokens_per_s": meta["n_tokens"] / dt,
            "tokens": meta["n_tokens"], "docs": meta["n_docs"], "out": str(out)}  # fmt: skip


def bench_loader(token_dir: str, seq_len: int, steps: int, global_batch: int, micro_batch: int) -> dict:
    bundle = build_data(DataConfig(name="tokens", path=token_dir, val_fraction=0.01), seq_len, seed=0)
    loader = BatchLoader(bundle.train, global_batch, micro_batch, rank=0, world_size=1, seed=0)
    loader.next_step()  # thread start-up and first page-in are not steady state
    t0 = time.perf_counter()
    for _ in range(steps):
        batches = loader.next_step()
    dt = time.perf_counter() - t0
    loader.close()
    assert batches[0].shape == (micro_batch, seq_len + 1)
    samples = steps * global_batch
    return {"seq_len": seq_len, "windows": len(bundle.train), "global_batch": global_batch, "micro_batch": micro_batch,
            "samples_per_s": samples / dt, "tokens_per_s": samples * seq_len / dt}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chars", type=int, default=16_000_000, help="corpus size in characters")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    consumes = "what the tiny model consumes (default: above the ~3,400 tokens/s the default run measures here)"
    p.add_argument("--model-tokens-per-s", type=float, default=5000.0, help=consumes)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "data_cpu.json"))
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["OPTIMUS_CACHE"] = str(work / "cache")  # verification markers of these throwaway shards
        docs = stdlib_docs(args.chars)
        jsonl = work / "corpus.jsonl"
        jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        n_bytes = sum(len(d.encode()) for d in docs)
        tok = work / "tok.json"
        train_bpe(docs[: max(1, len(docs) // 4)], 8192).save(str(tok))
        prep = [bench_prepare(jsonl, tok, work, n, n_bytes) for n in (1, 2)]
        load = bench_loader(prep[0]["out"], args.seq_len, args.steps, global_batch=64, micro_batch=8)

    ratio = load["tokens_per_s"] / args.model_tokens_per_s
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_avg_1min": os.getloadavg()[0],
        },  # other work on the machine skews these numbers
        "corpus": {"chars": sum(map(len, docs)), "bytes": n_bytes, "docs": len(docs)},
        "prepare": [{k: v for k, v in r.items() if k != "out"} for r in prep],
        "loader": load,
        "loader_vs_model": {"model_tokens_per_s": args.model_tokens_per_s, "ratio": ratio},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    print(f"corpus: {n_bytes / 1e6:.1f} MB, {len(docs)} documents, {prep[0]['tokens']} tokens")
    print(f"{'stage':<22}{'MB/s':>10}{'tokens/s':>14}{'samples/s':>12}")
    for r in prep:
        name = f"prepare, {r['num_proc']} proc"
        print(f"{name:<22}{r['MB_per_s']:>10.2f}{r['tokens_per_s']:>14,.0f}{'':>12}")
    name = f"loader, seq {args.seq_len}"
    print(f"{name:<22}{'':>10}{load['tokens_per_s']:>14,.0f}{load['samples_per_s']:>12,.0f}")
    print(f"loader delivers {ratio:,.0f}x the {args.model_tokens_per_s:,.0f} tokens/s the tiny model consumes")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
