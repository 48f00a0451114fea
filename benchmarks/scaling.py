"""Weak and strong scaling with expert parallelism: run a series through `optimus train`, then `optimus report`.

Here (local processes on this machine, gloo; EP = process count, EP-aware sharded optimizer):

    python benchmarks/scaling.py [--worlds 1,2,4] [--steps 14] [--warmup 4]

runs, for weak scaling, the batch per process fixed (global batch = per_device x world) and,
for strong scaling, the global batch fixed, each with `profile.timers=true`, and writes
benchmarks/results/scaling_cpu/{weak,strong}/ (report.md, .csv, .json and PNG plots).
Every rank runs one thread (OMP_NUM_THREADS=1), so a world larger than the core count is
oversubscribed and says more about the machine than about Optimus.

On a cluster it writes one job script per node count and mode instead of running:

    python benchmarks/scaling.py --cluster aurora --nodes 1,2,4,8 [--model mula-7b-a1b] [--out jobs/]
    # submit them (qsub / sbatch), then:
    optimus report <run dirs of one mode> --out <dir> --mode weak
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from memory import ADAMW  # noqa: E402  benchmarks/ is the script's directory, first on sys.path

from optimus.config import ConfigError  # noqa: E402

# A small MoE that still spends most of a step in matmuls on a CPU; 4 experts so EP can reach 4.
CPU_MODEL = [
    "model.n_layers=2", "model.dim=128", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=256",
    "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_dim=256", "model.vocab_size=1024",
    "data.vocab_size=1024",
]  # fmt: skip
COMMON = [
    *ADAMW, "train.seq_len=128", "train.micro_batch=4", "train.dtype=fp32", "train.eval_interval=100000",
    "train.eval_sequences=4", "train.log_interval=100000", "optim.sharding=ep_aware", "optim.warmup_steps=2",
    "profile.timers=true", "logging.progress=false",
]  # fmt: skip


def cpu_description() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def write_corpus(path: Path, max_chars: int = 2_000_000) -> Path:
    from optimus.data.sources import stdlib_docs

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in stdlib_docs(max_chars)), encoding="utf-8")
    return path


def series(mode: str, worlds: list[int], per_device: int, global_batch: int) -> list[tuple[int, list[str]]]:
    """(world, overrides) of each run: EP = world; the batch grows with the world (weak) or stays (strong)."""
    runs = []
    for world in worlds:
        batch = per_device * world if mode == "weak" else global_batch
        runs.append((world, [f"parallel.ep={world}", f"train.global_batch={batch}"]))
    return runs


def probe_peak() -> float:
    """fp32 matmul FLOP/s of one thread (every rank runs one), best of three: one peak for every run's MFU."""
    import torch

    from optimus.peak_flops import cpu_matmul_probe

    torch.set_num_threads(1)
    return max(cpu_matmul_probe(torch.float32) for _ in range(3))


def run_local(args) -> None:
    from optimus.report import build_report

    work = Path(args.work).resolve()
    corpus = write_corpus(work / "corpus.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPTIMUS_CACHE": str(work / "cache")}
    worlds = [int(w) for w in args.worlds.split(",")]
    load_before = os.getloadavg()[0]
    peak = probe_peak()  # per-run probes would differ with the load, and MFU with them
    for mode in ("weak", "strong"):
        run_dirs = []
        for world, overrides in series(mode, worlds, args.per_device, args.global_batch):
            run_dir = work / mode / f"world{world}-{time.strftime('%H%M%S')}"
            cmd = [
                sys.executable, "-m", "optimus", "train", *CPU_MODEL, *COMMON, "data=text", f"data.path={corpus}",
                f"train.steps={args.steps}", f"parallel.nproc={world}", f"machine.peak_flops={peak:.4g}", *overrides,
                f"run.dir={run_dir}",
            ]  # fmt: skip
            print(f"[{mode}] world {world}: {' '.join(overrides)}", flush=True)
            subprocess.run(cmd, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
            run_dirs.append(run_dir)
        notes = [
            f"Machine: {cpu_description()}; torch {__import__('torch').__version__}; gloo; 1 thread per rank",
            f"Load average (1 min) before the series: {load_before:.1f} (other work on the machine skews the numbers)",
            f"Model: {' '.join(CPU_MODEL)}; fp32; seq_len 128, micro_batch 4, EP = world, optim.sharding=ep_aware",
            f"MFU against {peak / 1e9:.1f} GFLOP/s, this CPU's fp32 matmul on one thread (one rank), measured once",
            f"Command: python benchmarks/scaling.py --worlds {args.worlds} --steps {args.steps} --warmup {args.warmup}",
        ]
        # The benchmark regenerates its own results folder: an earlier report there is replaced.
        build_report(run_dirs, Path(args.out) / mode, mode, args.warmup, notes, overwrite=True)


def emit_cluster(args) -> None:
    """One job script per (mode, node count), rendered from the machine's template by optimus.job_scripts."""
    from optimus.cli import load_config
    from optimus.job_scripts import DEFAULT_SCHEDULER, SCHEDULERS, render

    scheduler = DEFAULT_SCHEDULER[args.cluster]
    base = [f"model={args.model}", f"machine={args.cluster}", "optim.sharding=ep_aware", "profile.timers=true",
            *args.overrides]  # fmt: skip
    cfg = load_config(base)
    rpn = cfg.machine.ranks_per_node
    ep = args.ep or math.gcd(rpn, cfg.model.moe.n_experts)  # an EP group inside one node, dividing the experts
    node_counts = [int(n) for n in args.nodes.split(",")]
    strong_batch = args.global_batch or args.per_device * max(node_counts) * rpn
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for mode in ("weak", "strong"):
        dirs = []
        for nodes in node_counts:
            world = nodes * rpn
            batch = args.per_device * world if mode == "weak" else strong_batch
            overrides = [*base, f"parallel.ep={ep}", f"train.global_batch={batch}", "train.micro_batch=1",
                         f"train.steps={args.steps}"]  # fmt: skip
            run_dir = Path(args.run_root).resolve() / f"scaling-{mode}-{nodes}n"
            script = render(scheduler, nodes, load_config(overrides), overrides, run_dir=run_dir,
                            job_name=f"scale-{mode}-{nodes}n", account=args.account, queue=args.queue,
                            walltime=args.walltime)  # fmt: skip
            path = out / f"{mode}-{nodes}n{SCHEDULERS[scheduler][1]}"
            path.write_text(script)
            dirs.append(str(run_dir))
            print(f"wrote {path}")
        print(f"after the {mode} jobs: optimus report {' '.join(dirs)} --out {out / mode} --mode {mode}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,4", help="local process counts (EP = process count)")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4, help="steps dropped from each run")
    p.add_argument("--per-device", type=int, default=4, help="weak scaling: sequences per device per step")
    p.add_argument(
        "--global-batch",
        type=int,
        help="strong scaling: sequences per step (default: 16 here; per-device x the largest world on a cluster)",
    )
    p.add_argument("--work", default="/tmp/optimus-scaling", help="run directories of the local series")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "scaling_cpu"))
    p.add_argument("--cluster", choices=("aurora", "frontier"), help="emit job scripts for this machine instead")
    p.add_argument("--nodes", default="1,2,4", help="cluster: node counts")
    p.add_argument("--model", default="mula-7b-a1b", help="cluster: model recipe")
    p.add_argument("--ep", type=int, help="cluster: EP size (default: ranks per node)")
    p.add_argument("--run-root", default="runs", help="cluster: parent of the run directories")
    p.add_argument("--account")
    p.add_argument("--queue")
    p.add_argument("--walltime", default="00:30:00")
    p.add_argument("overrides", nargs="*", help="cluster: extra Hydra overrides (train.seq_len=4096 ...)")
    args = p.parse_args()
    try:
        if args.cluster:
            if args.out == p.get_default("out"):
                args.out = "scaling-jobs"
            emit_cluster(args)
        else:
            args.global_batch = args.global_batch or 16
            run_local(args)
    except ConfigError as err:
        print(f"scaling.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
