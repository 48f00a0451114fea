"""Where one profiled training step's time goes on the device: a chrome trace (`profile.torch=true`) summarised.

    python benchmarks/gpu/profile_summary.py RUN_DIR/trace_rank0.json [--top 30]

Prints, as markdown: the traced span, the time the device ran kernels (the union of their intervals) and the
time it sat idle waiting for the host; the kernels by total device time (calls, ms, share), grouped by kind
(matrix products, Triton kernels, attention, elementwise and reductions, copies); and the host's runtime
calls by total time (a synchronising call there, such as cudaStreamSynchronize or a device-to-host
cudaMemcpy, stalls the launch queue).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
KINDS = (  # first match wins: Optimus's Triton kernels (optimus/kernels/triton_kernels.py) before cuBLAS's GEMMs
    ("Triton expert kernels", r"^_(grouped|swiglu|segment|combine|permute|expert|gather|scatter)\w*_kernel$"),
    ("matrix products (cuBLAS/CUTLASS)", r"gemm|gemv|cutlass|xmma|nvjet|cublas|wgmma"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("optimizer", r"adam|foreach|multi_tensor|lerp"),
    ("copies and fills", r"memcpy|memset|copy|fill"),
    ("elementwise and reductions", r"elementwise|vectorized|reduce|softmax|norm|index|gather|scatter|cat|sort"),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarise(trace_path: Path, top: int) -> str:
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver", "xpu_runtime")]
    if not device:
        return f"{trace_path}: no device events (a CPU run, or a profiler without device activity)\n"
    span_us = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    busy_us = union_length([(e["ts"], e["ts"] + e["dur"]) for e in device])
    lines = [f"# {trace_path.name}", ""]
    lines.append(f"- traced span {span_us / 1e3:.1f} ms; device busy {busy_us / 1e3:.1f} ms ({busy_us / span_us:.0%})")
    lines.append(f"- device idle (waiting for the host) {(span_us - busy_us) / 1e3:.1f} ms")
    per_name = defaultdict(lambda: [0, 0.0])
    for e in device:
        per_name[e["name"]][0] += 1
        per_name[e["name"]][1] += e["dur"]
    device_us = sum(t for _, t in per_name.values())
    per_kind = defaultdict(float)
    for name, (_, t) in per_name.items():
        per_kind[kind_of(name)] += t
    lines += ["", "| kind | device ms | share |", "|---|---:|---:|"]
    for kind, t in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {t / 1e3:.1f} | {t / device_us:.1%} |")
    lines += ["", f"| top {top} kernels | calls | device ms | share | kind |", "|---|---:|---:|---:|---|"]
    for name, (calls, t) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {calls} | {t / 1e3:.2f} | {t / device_us:.1%} | {kind_of(name)} |")
    per_call = defaultdict(lambda: [0, 0.0])
    for e in runtime:
        per_call[e["name"]][0] += 1
        per_call[e["name"]][1] += e["dur"]
    lines += ["", "| host runtime call | calls | host ms |", "|---|---:|---:|"]
    for name, (calls, t) in sorted(per_call.items(), key=lambda kv: -kv[1][1])[:12]:
        lines.append(f"| `{name}` | {calls} | {t / 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    print(summarise(args.trace, args.top), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
