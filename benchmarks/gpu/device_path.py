"""The device path's trace against the device: is the step `optimus plan --dry-run --device cuda` traces on a
machine without a GPU the step the GPU runs?

    python benchmarks/gpu/device_path.py --out device_path.json            # on a GPU: a 2-layer mula-7b-a1b
    python benchmarks/gpu/device_path.py --tiny --out device_path.json     # anywhere: the tiny model

One training step of a small MoE model (every expert on one device, AdamW, bf16), run twice:

  device   for real, on this machine's accelerator (`machine.device=auto`), with `optimus.operators.OperatorCounter`
           active: the operators that launched a kernel, their calls, FLOPs and bytes, and the allocator's peak
           over the step (from the model's build on, as the dry run measures it)
  traced   `optimus.dry_run.dry_run_rank(cfg, 1, 0, device=<this accelerator's path>)` in a child process: the
           same step on fake tensors of the stand-in device (optimus.fake_device), its operators and MemTracker peak

Both are the first step after the build (the optimizer's state is made in it, as in the dry run), with the same
recipe, kernels (`auto`: Triton where it compiles) and no start-up kernel check. The JSON holds both operator
tables, the operators whose name, calls or FLOPs differ, and the two peaks beside `optimus plan`'s.
Without an accelerator the device run is the CPU path: its differences from the cuda trace are the CPU's own
schedule, which is what the --tiny run on a CPU shows (benchmarks/gpu/run.sh's CPU path runs it that way).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from optimus.device_memory import max_memory_allocated, reset_peak_memory, synchronize
from optimus.dry_run import FakeBatches, dry_run_rank
from optimus.operators import OperatorCounter
from optimus.platform import detect_platform
from optimus.recipes import load_config
from optimus.run_spec import resolve_run

STEP = ["model=mula-7b-a1b", "model.n_layers=2", "train.seq_len=2048", "train.micro_batch=4", "train.global_batch=8"]
TINY_STEP = ["model=tiny", "train.seq_len=64", "train.micro_batch=2", "train.global_batch=4"]
COMMON = ["optim.update=adamw", "check_kernels=false", "parallel.check_collectives=false"]


def device_step(cfg) -> dict:
    """One real step on this machine's device: its operators and the allocator's peak (0 on a CPU)."""
    from optimus.train.step import TrainStep, parallel_state_of

    platform = detect_platform(cfg.machine, 0)
    spec = resolve_run(cfg, 1, platform)
    reset_peak_memory(platform)
    step = TrainStep(spec, parallel_state_of(spec))
    t = spec.cfg.train
    batches = FakeBatches(step.accum, t.micro_batch, t.seq_len, spec.cfg.model.vocab_size, step.device)
    operators = OperatorCounter()
    with operators:  # the micro-batches' making counted too, as in a dry run
        step.run(batches.next_step(), 0, lambda: False)
    synchronize(platform)
    return {
        "device": platform.path,
        "device_name": platform.device_name,
        "kernels": step.kernels.name,
        "peak_bytes": max_memory_allocated(platform),
        "operators": operators.summary(),
    }


def differences(device: dict, traced: dict) -> list[dict]:
    """Every operator whose calls or FLOPs differ between the two tables (absent: 0), and whose bytes differ by more
    than 1% (the stand-in prices a view's bytes as the device does; a real kernel may differ in a padding)."""
    rows = []
    for name in sorted(set(device) | set(traced)):
        d, t = device.get(name, {}), traced.get(name, {})
        got = {k: (d.get(k, 0), t.get(k, 0)) for k in ("calls", "flops", "bytes")}
        calls, flops, moved = got["calls"], got["flops"], got["bytes"]
        if calls[0] != calls[1] or flops[0] != flops[1] or abs(moved[0] - moved[1]) > 0.01 * max(moved):
            rows.append({"operator": name, **{f"{k}_device": v[0] for k, v in got.items()},
                         **{f"{k}_traced": v[1] for k, v in got.items()}})  # fmt: skip
    return rows


def traced_step(overrides: list[str], path: str) -> dict:
    """`dry_run_rank` of the step on the `path` stand-in, in a child process: registering the stand-in device makes
    it torch's accelerator, whose streams the autograd engine then asks for in a real GPU's backward (an internal
    assert in torch 2.11), so the device's step and the stand-in never share a process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.json"
        cmd = [sys.executable, __file__, "--trace", path, "--out", str(out), *overrides]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def trace_main(overrides: list[str], path: str, out: Path) -> int:
    trace = dry_run_rank(load_config(overrides), 1, 0, device=path)
    traced = {"device": trace["device"], "kernels": trace["kernels"], "peak_bytes": trace["memory"]["peak_bytes"],
              "planned_bytes": trace["memory"]["planned_bytes"], "operators": trace["operators"]}  # fmt: skip
    out.write_text(json.dumps(traced))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model (a CPU's minute)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument("--trace", metavar="PATH", help=argparse.SUPPRESS)  # (the child process of traced_step)
    parser.add_argument("overrides", nargs="*", help="recipe overrides laid over the step's")
    args = parser.parse_args(argv)
    if args.trace:
        return trace_main(args.overrides, args.trace, args.out)
    overrides = [*(TINY_STEP if args.tiny else STEP), *COMMON, *args.overrides]

    device = device_step(load_config(overrides))
    path = device["device"] if device["device"] != "cpu" else "cuda"  # a CPU's run is compared with a cuda trace
    traced = traced_step(overrides, path)
    diff = differences(device["operators"], traced["operators"])
    result = {"overrides": overrides, "device_run": device, "traced": traced, "differences": diff}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    gib = 2.0**30
    print(f"device run on {device['device']} ({device['device_name']}), kernels={device['kernels']}: "
          f"{len(device['operators'])} operators, peak {device['peak_bytes'] / gib:.2f} GiB")  # fmt: skip
    print(
        f"traced on the {traced['device']} stand-in, kernels={traced['kernels']}: {len(traced['operators'])} "
        f"operators, peak {traced['peak_bytes'] / gib:.2f} GiB, planned {traced['planned_bytes'] / gib:.2f} GiB"
    )
    if device["peak_bytes"]:
        print(f"traced peak / device peak: {traced['peak_bytes'] / device['peak_bytes']:.3f}")
    print(f"{len(diff)} operators differ in calls, FLOPs or bytes (>1%):")
    for row in diff:
        print(f"  {row['operator']}: calls {row['calls_device']} / {row['calls_traced']}, GFLOP "
              f"{row['flops_device'] / 1e9:.3f} / {row['flops_traced'] / 1e9:.3f}, MB {row['bytes_device'] / 1e6:.1f}"
              f" / {row['bytes_traced'] / 1e6:.1f}  (device / traced)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
