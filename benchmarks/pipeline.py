"""Pipeline bubble: measured idle fraction of the first pipeline rank against the schedule's theory.

With `pp` stages of equal time and `m` micro-batches per step, GPipe and 1F1B both leave each
rank idle for (pp - 1) of the (m + pp - 1) forward+backward slots of a step: the bubble fraction
(pp - 1) / (m + pp - 1). This runs `optimus train` (a dense model, fp32, local gloo processes,
profile.timers=true) for each schedule, pp and m, and reads from metrics.jsonl, per step,

    busy  = time_forward_s + time_backward_s   (rank 0's stage: its forwards and backwards)
    idle  = time_pipeline_wait_s              (the rest of the schedule: waiting, and the transfers)
    bubble = idle / (busy + idle)

median over the steps after the first. The stage split is the automatic one (the embedding
and head counted), and `stage_time_s` (every stage's forward + backward time) shows how even
the stages were: the theory assumes equal ones.

    python benchmarks/pipeline.py [--steps 6] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from memory import ADAMW  # benchmarks/ is the script's directory, first on sys.path

from optimus.cli import main as optimus_main

MODEL = [
    "model.n_layers=8", "model.dim=256", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=1024",
    "model.moe.n_experts=0", "model.vocab_size=2048", "data.vocab_size=2048",
]  # fmt: skip
TRAIN = [
    *ADAMW, "train.dtype=fp32", "kernels=torch", "train.seq_len=128", "train.micro_batch=2", "logging.progress=false",
]  # fmt: skip
CASES = [(schedule, pp, m) for schedule in ("gpipe", "1f1b") for pp in (2, 4) for m in (pp, 2 * pp, 4 * pp)]


def theoretical_bubble(pp: int, m: int) -> float:
    return (pp - 1) / (m + pp - 1)


def measure(schedule: str, pp: int, m: int, steps: int, corpus: Path, root: Path) -> dict:
    """One run of `steps` steps at pp stages (one rank each) and m micro-batches per step."""
    run_dir = root / f"{schedule}-pp{pp}-m{m}"
    layout = [f"parallel.nproc={pp}", f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}"]
    batch = [f"train.global_batch={2 * m}", f"train.steps={steps}", f"train.eval_interval={steps}"]
    data = ["data=text", f"data.path={corpus}", "train.eval_sequences=2", "profile.timers=true"]
    assert optimus_main(["train", *MODEL, *TRAIN, *layout, *batch, *data, f"run.dir={run_dir}"]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]  # from step 2
    bubbles, stage_imbalance = [], []
    for r in records:
        busy = r["time_forward_s"] + r["time_backward_s"]
        bubbles.append(r["time_pipeline_wait_s"] / (busy + r["time_pipeline_wait_s"]))
        stage_imbalance.append(max(r["stage_time_s"]) / min(r["stage_time_s"]))
    return {
        "schedule": schedule, "pp": pp, "micro_batches": m,
        "bubble_measured": statistics.median(bubbles), "bubble_theory": theoretical_bubble(pp, m),
        "stage_time_max_over_min": statistics.median(stage_imbalance),
        "step_time_s": statistics.median(r["step_time_s"] for r in records),
    }  # fmt: skip


def machine_line() -> str:
    flags = subprocess.run(
        "grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\\n' ' '", shell=True, capture_output=True, text=True
    ).stdout.strip()
    return (
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"avx512: {flags or 'none'}, load average {os.getloadavg()[0]:.1f} at the end."
    )


def write_table(rows: list[dict], steps: int) -> str:
    lines = [
        f"# Pipeline bubble, dense 8-layer model, one rank per stage (`python benchmarks/pipeline.py --steps {steps}`)",
        "",
        machine_line(),
        "",
        "| schedule | pp | micro-batches m | bubble measured | (pp-1)/(m+pp-1) | stage time max/min | step time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['pp']} | {r['micro_batches']} | {r['bubble_measured']:.3f} | "
            f"{r['bubble_theory']:.3f} | {r['stage_time_max_over_min']:.2f} | {r['step_time_s']:.3f} |"
        )
    if any(r["pp"] > (os.cpu_count() or 1) for r in rows):
        lines += [
            "",
            f"With more ranks than cores (pp > {os.cpu_count()} here) the ranks take turns on the cores and the time "
            "a rank waits for a core counts as idle: those rows overstate the bubble. Other jobs shared the "
            "machine (the load average above), which adds the same kind of noise to every row.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: the ranks share the cores
    from scaling import write_corpus  # benchmarks/scaling.py: Python's own documentation as a corpus

    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp) / "corpus.jsonl", max_chars=300_000)
        rows = [measure(schedule, pp, m, args.steps, corpus, Path(tmp)) for schedule, pp, m in CASES]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline_cpu.json").write_text(json.dumps(rows, indent=2) + "\n")
    text = write_table(rows, args.steps)
    (args.out / "pipeline_cpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
