"""Where the model under-prices a GPU step: the traced step's operators priced by kind beside a profile's device time.

    python benchmarks/gpu/priced_kinds.py RESULTS_DIR          # e.g. benchmarks/results/gpu/h200-2026-11-29

Traces run.sh's training step on the cuda stand-in (the dry run `optimus plan --predict` replays; no GPU needed),
prices each operator call with `optimus.perf.costs.op_time` on RESULTS_DIR's calibration/machine.yaml (its
measured time where the calibration timed the step's operators, calibration/operators.json; else the roofline
with the calibration's kernel floor), and prints the device time by kind beside the profiled step's
(RESULTS_DIR/profile.md, written by profile_summary.py).
"""

from __future__ import annotations

import argparse
import json
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


def priced(trace: dict, machine) -> dict[str, list[float]]:
    """{kind: [calls, calls priced by a measured time, seconds, seconds of the kernel floor]}: every operator call of
    the trace priced by optimus.perf.costs.op_time, and again without the floor for what the floor adds."""
    from optimus.perf.costs import op_time

    floorless = machine.with_values(kernel_floor=0.0)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
    for event in trace["events"]:
        for kind, flops, moved, fp32, signature, count in event["ops"] if event["e"] == "ops" else ():
            if kind == "view":
                continue
            op = json.loads(signature)[0].rsplit(".", 1)[0]  # aten.mm.default -> aten.mm
            seconds = op_time(machine, kind, flops, moved, fp32, signature)
            entry = by_kind[kind_of(op, flops)]
            entry[0] += count
            entry[1] += count if signature in machine.op_seconds else 0
            entry[2] += count * seconds
            entry[3] += count * (seconds - op_time(floorless, kind, flops, moved, fp32, signature))
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
    trace = trace_step(cfg, 1, progress="stderr", device="cuda", signatures=True)[0]
    machine = machine_model(cfg.machine)
    measured = profiled(args.results / "profile.md")
    print("| kind | calls traced | of which timed | priced ms | of which the kernel floor | profiled ms | "
          "profiled / priced |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    total = [0.0, 0.0]
    rows = sorted(priced(trace, machine).items(), key=lambda kv: -kv[1][2])
    for kind, (calls, timed, seconds, floor) in rows:
        ms = measured.get(kind)
        ratio = f"{ms / (seconds * 1e3):.2f}" if ms else "-"
        print(f"| {kind} | {calls:,} | {timed:,} | {seconds * 1e3:.1f} | {floor * 1e3:.1f} | {ms if ms else '-'} | "
              f"{ratio} |")  # fmt: skip
        total = [total[0] + seconds * 1e3, total[1] + (ms or 0.0)]
    print(f"| all | | {total[0]:.1f} | | {total[1]:.1f} | {total[1] / total[0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
