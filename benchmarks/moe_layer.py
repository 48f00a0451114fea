"""Expert-path throughput: forward+backward of permute -> SwiGLU experts -> combine.

    python benchmarks/moe_layer.py                     # S1 and S2, bf16 and fp32, on this machine
    python benchmarks/moe_layer.py --scenarios S1 --dtypes bf16 --iters 7

FLOPs counted (expert FLOPs): only the expert GEMMs, 2*M*N*K per GEMM. Forward is
x@W13 (2*A*D*2F) + h@W2 (2*A*F*D) = 2*A*D*3F with A = T*K assignments; backward is twice
that (input and weight grads), so fwd+bwd = 6*A*D*3F. Permute, combine, SwiGLU elementwise
math and the router are timed but not counted.

Rows (methods):
  torch         the torch kernel backend (torch._grouped_mm where available)
  torch_loop    the torch backend's Function with its per-expert torch.mm loop forced
  triton        the triton backend (GPU only)
  reference     autograd through optimus.kernels.reference (per-expert loop, as one would write it)
  moe_layer     the whole optimus.model.moe.MoE layer with kernels=torch, router included (its own routing)
  dense         the roofline: one dense [A, D] x [D, 3F] linear fwd+bwd (dx and dW), same FLOPs.
                For 16-bit dtypes on a CPU without 16-bit matmul units it is measured two ways and
                the faster one is the roofline: `dense` (16-bit-rounded operands, fp32 GEMM: what the
                torch backend does) and `dense_native` (torch's own 16-bit matmul, on A/8 rows).

bf16 means training's mixed precision: fp32 weights and activations under torch.autocast(bf16).
Routing is balanced random top-k (each token picks K distinct experts uniformly). Methods are
timed round-robin (one iteration of each in turn) so that load from other processes hits all of
them alike; the reported time is the median.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from optimus.kernels import get_backend, gpu_present, reference, torch_backend
from optimus.kernels.dtypes import math_dtype
from optimus.platform import keep_cpu_allocations

SCENARIOS = {
    "S1": dict(T=4096, D=512, F=1024, E=8, K=2),
    "S2": dict(T=4096, D=512, F=256, E=64, K=8),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def expert_flops(T, D, F, E, K) -> float:
    return 6.0 * (T * K) * D * 3 * F


def autocast(device: str, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype)


def make_expert_step(ops, s, dtype, device, gen, force_loop=False):
    """A closure running the expert path forward+backward once."""
    T, D, F, E, K = s["T"], s["D"], s["F"], s["E"], s["K"]
    token_idx_A, weight_A, offsets_E = reference.random_routing(T, E, K, gen)
    x_TD = torch.randn(T, D, generator=gen).to(device).requires_grad_()
    w13 = (torch.randn(E, D, 2 * F, generator=gen) / D**0.5).to(device).requires_grad_()
    w2 = (torch.randn(E, F, D, generator=gen) / F**0.5).to(device).requires_grad_()
    weight_A = weight_A.to(device).requires_grad_()
    token_idx_A, offsets_E = token_idx_A.to(device), offsets_E.to(device)
    dout_TD = torch.randn(T, D, generator=gen).to(device)

    def step():
        saved = torch_backend._HAS_GROUPED_MM
        torch_backend._HAS_GROUPED_MM = saved and not force_loop
        try:
            with autocast(device, dtype):
                x_AD = ops.permute(x_TD, token_idx_A)
                y_AD = ops.expert_swiglu_mlp(x_AD, w13, w2, offsets_E)
                out_TD = ops.combine(y_AD, token_idx_A, weight_A, T)
            torch.autograd.grad(out_TD, (x_TD, w13, w2, weight_A), dout_TD.to(out_TD.dtype))
        finally:
            torch_backend._HAS_GROUPED_MM = saved

    return step


def make_dense_step(s, dtype, device, gen, native: bool, row_fraction: int = 1):
    """One dense [A, D] x [D, 3F] linear, fwd + bwd (dx, dW): the equal-FLOP GEMM roofline."""
    A = s["T"] * s["K"] // row_fraction
    D, N = s["D"], 3 * s["F"]
    x = torch.randn(A, D, generator=gen).to(device).requires_grad_()
    w = (torch.randn(D, N, generator=gen) / D**0.5).to(device).requires_grad_()
    dy = torch.randn(A, N, generator=gen).to(device)
    math = math_dtype(dtype, torch.device(device))

    def step():
        if native or math == dtype:
            with autocast(device, dtype):
                y = x @ w
        else:  # 16-bit-rounded operands, fp32 GEMM (products of 16-bit values are exact in fp32)
            y = (x.to(dtype).to(math) @ w.to(dtype).to(math)).to(dtype)
        torch.autograd.grad(y, (x, w), dy.to(y.dtype))

    return step


def make_moe_step(s, dtype, device, gen):
    from optimus.config import MoEConfig
    from optimus.model.moe import layer

    T, D, F, E, K = s["T"], s["D"], s["F"], s["E"], s["K"]
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    # Router losses weighted 1, as before: their gradients ride on the backward of y.
    moe_cfg = MoEConfig(n_experts=E, top_k=K, expert_dim=F, aux_loss_coef=1.0, z_loss_coef=1.0)
    moe = layer.MoE(D, moe_cfg, kernels="torch").to(device)
    for p in moe.parameters():  # the layer leaves initialisation to the model
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, T, D, generator=gen).to(device).requires_grad_()
    dout = torch.randn(1, T, D, generator=gen).to(device)
    params = [x, *moe.parameters()]

    def step():
        with autocast(device, dtype):
            y = moe(x)
        loss_terms = (y * dout.to(y.dtype)).float().sum()
        torch.autograd.grad(loss_terms, params, allow_unused=True)

    return step


def time_round_robin(steps: dict, iters: int, warmup: int) -> dict:
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    names = list(steps)
    for i in range(iters):
        # Rotate the order so no method is always the one that runs after the largest frees.
        for name in names[i % len(names) :] + names[: i % len(names)]:
            step = steps[name]
            t0 = time.perf_counter()
            step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_case(name, s, dtype_name, device, iters, warmup, with_reference):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(0)
    flops = expert_flops(**s)
    steps, scale = {}, {}
    steps["torch"] = make_expert_step(get_backend("torch"), s, dtype, device, gen)
    steps["torch_loop"] = make_expert_step(get_backend("torch"), s, dtype, device, gen, force_loop=True)
    if device != "cpu":
        steps["triton"] = make_expert_step(get_backend("triton"), s, dtype, device, gen)
    if with_reference:
        steps["reference"] = make_expert_step(reference, s, dtype, device, gen)
    try:
        steps["moe_layer"] = make_moe_step(s, dtype, device, gen)
    except ImportError:
        pass  # optimus.model.moe not there yet
    steps["dense"] = make_dense_step(s, dtype, device, gen, native=False)
    if math_dtype(dtype, torch.device(device)) != dtype:
        steps["dense_native"] = make_dense_step(s, dtype, device, gen, native=True, row_fraction=8)
        scale["dense_native"] = 8
    medians = time_round_robin(steps, iters, warmup)
    rows = {}
    for method, t in medians.items():
        f = flops / scale.get(method, 1)
        rows[method] = {"seconds": t, "gflops_per_s": f / t / 1e9}
    roofline = max(rows[m]["gflops_per_s"] for m in rows if m.startswith("dense"))
    for r in rows.values():
        r["fraction_of_dense"] = r["gflops_per_s"] / roofline
    return {
        "scenario": name,
        "dtype": dtype_name,
        **s,
        "expert_gflop": flops / 1e9,
        "roofline_gflops_per_s": roofline,
        "methods": rows,
    }


def print_table(results):
    print(f"{'case':<10} {'method':<13} {'ms':>9} {'GFLOP/s':>9} {'of dense':>9}")
    for r in results:
        for method, m in r["methods"].items():
            case = f"{r['scenario']} {r['dtype']}"
            ms, gf, frac = m["seconds"] * 1e3, m["gflops_per_s"], m["fraction_of_dense"]
            print(f"{case:<10} {method:<13} {ms:9.1f} {gf:9.1f} {frac:9.1%}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="S1,S2")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if gpu_present() and torch.cuda.is_available() else "cpu")
    ref_help = "time the reference loop (auto: only where its native 16-bit CPU matmuls are not minutes long)"
    parser.add_argument("--reference", choices=("auto", "on", "off"), default="auto", help=ref_help)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/moe_layer_<device>.json)")
    parser.add_argument("--default-malloc", action="store_true", help="skip keep_cpu_allocations (what training does)")
    args = parser.parse_args()
    kept = args.device == "cpu" and not args.default_malloc and keep_cpu_allocations()
    results = []
    for name in args.scenarios.split(","):
        for dtype_name in args.dtypes.split(","):
            with_ref = args.reference == "on" or (
                args.reference == "auto"
                and math_dtype(DTYPES[dtype_name], torch.device(args.device)) == DTYPES[dtype_name]
            )
            results.append(run_case(name, SCENARIOS[name], dtype_name, args.device, args.iters, args.warmup, with_ref))
            print_table(results[-1:])
    out = Path(args.out or Path(__file__).parent / "results" / f"moe_layer_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "iters": args.iters,
        "load_average": os.getloadavg(),
        "malloc_kept": kept,
        "flops_counted": "expert GEMMs only: 6 * (T*K) * D * 3F per fwd+bwd",
    }
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print("\nall cases:")
    print_table(results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
