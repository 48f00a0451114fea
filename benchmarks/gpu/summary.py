"""benchmarks/gpu/run.sh's environment record and its summary page.

python benchmarks/gpu/summary.py --environment      # JSON: device, driver, torch, Triton, CPU
python benchmarks/gpu/summary.py --out DIR          # markdown from DIR's stage logs and results
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

SKIPPED_STEPS = 2  # the first steps compile kernels, autotune and warm the allocator


def device_rates(device: str) -> dict:
    """The two ceilings measured on the device: a bf16 8192^3 matrix product (TFLOP/s) and a 2 GiB device-to-device
    copy (GB/s, bytes read plus written); medians of 10 after 3 warm-ups, on random data, issued back to back."""
    import torch

    api = torch.get_device_module(device)

    def median_seconds(fn) -> float:
        for _ in range(3):
            fn()
        api.synchronize()
        events = []
        for _ in range(10):
            start, end = api.Event(enable_timing=True), api.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        api.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3

    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    gemm_tflops = 2 * n**3 / median_seconds(lambda: a @ b) / 1e12
    src = torch.randn(2**29, device=device)  # 2 GiB of fp32
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src)) / 1e9
    return {"bf16_gemm_tflops_8192": gemm_tflops, "copy_gbs": copy_gbs}


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    env["hip"] = torch.version.hip
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # absent or broken: say which
        env["triton"] = f"not importable ({type(e).__name__})"
    xpu = getattr(torch, "xpu", None)
    device = "cuda" if torch.cuda.is_available() else "xpu" if xpu is not None and xpu.is_available() else None
    if device is not None:
        props = torch.get_device_module(device).get_device_properties(0)
        env.update(device=props.name, multiprocessors=getattr(props, "multi_processor_count", None))
        env["memory_gib"] = props.total_memory / 2**30
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
        env.update(device_rates(device))
    else:
        env["device"] = "cpu (no GPU visible: tiny shapes)"
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.*)", cpuinfo)
    env["cpu"] = model.group(1) if model else platform.machine()
    env["cpu_flags"] = sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|amx[a-z_0-9]*)\b", cpuinfo)))
    return env


MACHINE_KEYS = ("peak_flops", "memory_gb", "perf.gemm_efficiency", "perf.memory_bandwidth_gbs", "perf.kernel_floor_us")


def machine_overrides(machine_yaml: Path) -> list[str]:
    """`machine.KEY=VALUE` for the numbers a selftest's machine.yaml measured or found on this node: what the
    `predict` stage lays over machine=nvidia, so that the prediction rests on this node's calibration."""
    import yaml

    machine = yaml.safe_load(machine_yaml.read_text())
    overrides = []
    for key in MACHINE_KEYS:
        value = machine
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            overrides.append(f"machine.{key}={value}")
    return overrides


def step_summary(run_dir: Path) -> dict | None:
    """Medians over the logged steps after the first SKIPPED_STEPS: seconds, tokens/s, TFLOP/s, MFU; peak memory."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "step_time_s" in r and r["step"] > SKIPPED_STEPS]
    if not steps:
        return None
    summary = {"steps": [r["step"] for r in steps], "tokens_per_step": steps[-1]["tokens"]}
    for key in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu"):
        values = [r[key] for r in steps if r.get(key) is not None]
        summary[key] = statistics.median(values) if values else None
    summary["peak_memory_gib"] = max(r.get("peak_memory_bytes") or 0 for r in steps) / 2**30
    summary["final_loss"] = steps[-1]["loss"]
    return summary


def markdown(out: Path) -> str:
    env = json.loads((out / "environment.json").read_text())
    lines = ["# benchmarks/gpu/run.sh", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "| stage | exit | seconds |", "|---|---:|---:|"]
    stages = (out / "stages.txt").read_text().split("\n") if (out / "stages.txt").exists() else []
    for line in filter(None, stages):
        name, rc, seconds = line.split()
        lines.append(f"| {name} | {rc} | {seconds} |")
    selftest_log = out / "selftest.log"
    if selftest_log.exists():
        lines += ["", "## optimus selftest", "", "```", *selftest_log.read_text().splitlines()[-40:], "```"]
    tests_log = out / "kernel_tests.log"
    if tests_log.exists():
        tail = [ln for ln in tests_log.read_text().splitlines() if ln.strip()][-1:]
        lines += ["", f"kernel tests on the device: {tail[0] if tail else 'no output'}"]
    expert = out / "expert_path.json"
    if expert.exists():
        sys.path.insert(0, str(Path(__file__).parent))
        from expert_path import markdown as expert_table

        data = json.loads(expert.read_text())
        methods = list(dict.fromkeys(m for c in data["cases"] for m in c["methods"] if m != "dense"))
        lines += ["", "## Expert path: TFLOP/s (fraction of a dense GEMM of the same FLOPs, same run)", ""]
        lines += [expert_table(data["cases"], methods), ""]
        for c in data["cases"]:
            lines.append(f"- {c['shape']} {c['dtype']}: the torch backend's GEMM is {c['torch_backend_gemm']}")
    device_path = out / "device_path.json"
    if device_path.exists():
        data = json.loads(device_path.read_text())
        run, traced, gib = data["device_run"], data["traced"], 2.0**30
        lines += ["", "## The dry run's trace against the device (`device_path.py`: one step, operators, peak)", ""]
        lines += [f"- the step: {' '.join(data['overrides'])}",
                  f"- on the device ({run['device']}, kernels={run['kernels']}): {len(run['operators'])} operators, "
                  f"peak {run['peak_bytes'] / gib:.2f} GiB",
                  f"- traced on the {traced['device']} stand-in (kernels={traced['kernels']}): "
                  f"{len(traced['operators'])} operators, peak {traced['peak_bytes'] / gib:.2f} GiB; "
                  f"planned {traced['planned_bytes'] / gib:.2f} GiB",
                  f"- operators whose calls, FLOPs or bytes (>1%) differ: {len(data['differences'])}"]  # fmt: skip
        for row in data["differences"]:
            lines.append(
                f"  - {row['operator']}: calls {row['calls_device']} / {row['calls_traced']}, bytes "
                f"{row['bytes_device'] / 1e6:.1f} / {row['bytes_traced'] / 1e6:.1f} MB (device / traced)"
            )
    lines += ["", f"## One training step (medians over the steps after step {SKIPPED_STEPS})", ""]
    lines += ["| kernels | s/step | tokens/s | TFLOP/s | MFU | peak GiB | loss |", "|---|" + "---:|" * 6]
    for run_dir in sorted(d for d in out.glob("step_*") if d.is_dir()):
        s = step_summary(run_dir)
        if s is None:
            lines.append(f"| {run_dir.name[5:]} | no steps logged (see {run_dir.name}.log) | | | | | |")
            continue
        mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "n/a"
        lines.append(
            f"| {run_dir.name[5:]} | {s['step_time_s']:.3f} | {s['tokens_per_s']:,.0f} | {s['tflops_per_device']:.1f} "
            f"| {mfu} | {s['peak_memory_gib']:.1f} | {s['final_loss']:.3f} |"
        )
    predict_log = out / "predict.log"
    if predict_log.exists():
        predicted = [ln for ln in predict_log.read_text().splitlines() if ln.startswith(("predicted step", "  time"))]
        lines += ["", "## The step predicted from this node's calibration (`optimus plan --predict`)", ""]
        lines += [f"    {ln.strip()}" for ln in predicted] or [f"no prediction (see {predict_log.name})"]
    profile = out / "profile.md"
    if profile.exists():
        lines += ["", "## One profiled step (kernels=triton)", "", *profile.read_text().splitlines()[1:]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--environment", action="store_true", help="print the environment as JSON")
    parser.add_argument("--out", help="the run's directory: print its summary as markdown")
    parser.add_argument("--machine-overrides", type=Path, help="print a machine.yaml's measured numbers as overrides")
    args = parser.parse_args()
    if args.environment:
        print(json.dumps(environment(), indent=2))
    if args.machine_overrides:
        print(" ".join(machine_overrides(args.machine_overrides)))
    if args.out:
        print(markdown(Path(args.out)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
