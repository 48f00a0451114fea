"""benchmarks/gpu/run.sh end to end on this machine's path without a GPU: tiny shapes, the Triton interpreter.

The script is what a lent GPU node runs first; this keeps it working between loans: every stage exits 0, the
expert-path methods match the reference, and the summary holds the training step's measurements.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the full-size benchmarks")
def test_the_gpu_benchmark_runs_end_to_end_without_a_gpu(tmp_path, corpus_file):
    out = tmp_path / "gpu"
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        OPTIMUS_STEP_OVERRIDES=f"data=text data.path={corpus_file} logging.progress=false",
    )
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu/run.sh"), str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    stages = dict(line.split()[:2] for line in (out / "stages.txt").read_text().splitlines())
    assert stages == {"selftest": "0", "expert_path": "0", "device_path": "0", "step_torch": "0"}
    selftest = json.loads((out / "selftest" / "selftest.json").read_text())
    assert selftest["kernels"]["results"] and all(r["ok"] for r in selftest["kernels"]["results"])
    cases = json.loads((out / "expert_path.json").read_text())["cases"]
    assert {c["shape"] for c in cases} == {"tiny", "tiny-empty"}
    methods = ("torch", "loop", "triton") if importlib.util.find_spec("triton") else ("torch", "loop")
    for case in cases:
        for method in methods:
            assert case["methods"][method]["correct"], (case["shape"], method, case["methods"][method])
            assert case["methods"][method]["fwd+bwd"]["seconds"] > 0
    device_path = json.loads((out / "device_path.json").read_text())  # (a CPU's step against the cuda trace)
    assert (device_path["device_run"]["device"], device_path["traced"]["device"]) == ("cpu", "cuda")
    assert "aten._grouped_mm" not in device_path["device_run"]["operators"]  # the CPU's own schedule ...
    assert {"aten._grouped_mm", "optimus.triton_grouped_mm"} & set(device_path["traced"]["operators"])  # ... not
    summary = (out / "summary.md").read_text()
    step_row = next(line for line in summary.splitlines() if line.startswith("| torch |"))
    seconds, tokens_per_s = step_row.split("|")[2:4]
    assert float(seconds) > 0 and float(tokens_per_s.replace(",", "")) > 0
    assert json.loads((out / "environment.json").read_text())["torch"] == torch.__version__


def test_the_profile_summary_splits_device_time_by_kernel_and_finds_the_idle_time(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks/gpu"))
    try:
        from profile_summary import summarise, union_length
    finally:
        sys.path.remove(str(ROOT / "benchmarks/gpu"))
    assert union_length([(0, 10), (5, 12), (20, 25)]) == 17
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # the span: 100 us
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 10, "dur": 30},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 30, "dur": 20},  # overlaps: busy 40
        {"ph": "X", "cat": "kernel", "name": "_grouped_mm_kernel", "ts": 60, "dur": 10},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 55, "dur": 5},
    ]
    trace = tmp_path / "trace_rank0.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    text = summarise(trace, top=5)
    assert "traced span 0.1 ms; device busy 0.1 ms (50%)" in text
    assert "| matrix products (cuBLAS/CUTLASS) | 0.1 | 83.3% |" in text
    assert "| `_grouped_mm_kernel` | 1 | 0.01 | 16.7% | Triton expert kernels |" in text
    assert "| `cudaStreamSynchronize` | 1 | 0.0 |" in text
