"""Where the model under-prices a GPU step: the traced step's operators priced by kind beside a profile's device time.

    python benchmarks/gpu/priced_kinds.py RESULTS_DIR          # e.g. benchmarks/results/gpu/h200-2026-11-29

Traces run.sh's training step on the cuda stand-in (the dry run `optimus plan --predict` replays; no GPU needed),
prices each operator with `optimus.perf.costs.op_time` (the roofline on RESULTS_DIR's
calibration/machine.yaml, with its kernel floor), and prints the device time by kind beside the profiled step's
(RESULTS_DIR/profile.md, written by profile_summary.py). The trace keeps each operator's total calls, FLOPs and
bytes, so an operator is priced at its mean call: the totals hold, the shapes between calls are averaged.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

STEP = (  # run.sh's step_triton stage
    "model=mula-7b-a1b model.n_layers=8 train.seq_len=2048 train.micro_batch=4 train.global_batch=32 "
    "train.dtype=bf16 optim.update=adamw kernels=triton machine=nvidia machine.ranks_per_node=1"
).split()
COPIES = {"aten._to_copy", "aten.copy_", "aten.clone", "aten.fill_", "aten.zero_", "aten.cat", "aten.new_full"}


def kind_of(op: str, flops: int) -> str:
    """An operator's kind in profile_summary.py's names."""
    if op.startswith("optimus.triton"):
        return "Triton expert kernels"
    if "attention" in op or flops:  # cuDNN's attention counts among the matrix products there
        return "matrix products (cuBLAS/CUTLASS)"
    if "adam" in op or op.startswith("aten._foreach"):
        return "optimizer"
    return "copies and fills" if op in COPIES else "elementwise and reductions"


def priced(operators: dict, machine) -> dict[str, list[float]]:
    """{kind: [calls, seconds, seconds below the kernel floor]} with every operator's mean call priced by
    optimus.perf.costs.op_time, and again without the floor for what the floor adds."""
    from optimus.perf.costs import op_time

    floorless = machine.with_values(kernel_floor=0.0)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for op, row in operators.items():
        calls, flops, moved = row["calls"], row["flops"], row["bytes"]
        if not calls:
            continue
        kind = "attn" if "attention" in op else "mm" if flops else "mem"
        seconds = op_time(machine, kind, flops / calls, moved / calls, False)
        entry = by_kind[kind_of(op, flops)]
        entry[0] += calls
        entry[1] += calls * seconds
        entry[2] += calls * (seconds - op_time(floorless, kind, flops / calls, moved / calls, False))
    return by_kind


def profiled(profile_md: Path) -> dict[str, float]:
    """{kind: device ms} from profile.md's first table."""
    rows = re.findall(r"^\| ([a-zA-Z /()]+?) \| ([\d.]+) \| [\d.]+% \|$", profile_md.read_text(), re.M)
    return {kind: float(ms) for kind, ms in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a run.sh OUT_DIR with calibration/machine.yaml and profile.md")
    args = parser.parse_args()
    from optimus.perf.machine import machine_model
    from optimus.perf.predict import trace_step
    from optimus.recipes import load_config

    cfg = load_config([*STEP, f"machine.calibration={args.results / 'calibration' / 'machine.yaml'}"])
    trace = trace_step(cfg, 1, progress="stderr", device="cuda")[0]
    machine = machine_model(cfg.machine)
    measured = profiled(args.results / "profile.md")
    print("| kind | calls traced | priced ms | of which the kernel floor | profiled ms | profiled / priced |")
    print("|---|---:|---:|---:|---:|---:|")
    total = [0.0, 0.0]
    for kind, (calls, seconds, floor) in sorted(priced(trace["operators"], machine).items(), key=lambda kv: -kv[1][1]):
        ms = measured.get(kind)
        ratio = f"{ms / (seconds * 1e3):.2f}" if ms else "-"
        print(f"| {kind} | {calls:,} | {seconds * 1e3:.1f} | {floor * 1e3:.1f} | {ms if ms else '-'} | {ratio} |")
        total = [total[0] + seconds * 1e3, total[1] + (ms or 0.0)]
    print(f"| all | | {total[0]:.1f} | | {total[1]:.1f} | {total[1] / total[0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
