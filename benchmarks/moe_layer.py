"""MoE expert path forward+backward (permute -> SwiGLU experts -> combine) against a plain loop and the roofline.

    python benchmarks/moe_layer.py                  # every shape, bf16 and fp32 (a few minutes on 2 idle cores)
    python benchmarks/moe_layer.py --quick          # S1 and S2 only, 3 iterations (about a minute)
    python benchmarks/moe_layer.py --shapes S2 --dtypes bf16 --iters 9
    python benchmarks/moe_layer.py --peers          # with transformers' and torchtitan's expert paths as columns
    python benchmarks/moe_layer.py --shapes S1 --dtypes bf16 --methods optimus,loop_index_add --iters 15

FLOPs counted (expert FLOPs): only the expert GEMMs, 2*M*N*K per GEMM. Forward is
x@W13 (2*A*D*2F) + h@W2 (2*A*F*D) = 2*A*D*3F with A = T*K assignments; backward is twice
that (input and weight grads), so fwd+bwd = 6*A*D*3F. Permute, combine, SwiGLU elementwise
math and the router are timed but not counted. Each method's figure is printed as a fraction
of the roofline's GFLOP/s.

Methods (rows):
  optimus       the torch kernel backend's permute -> expert_swiglu_mlp -> combine: what the MoE
                layer runs (the expert-parallel dispatchers run the same with the token exchange
                in between)
  loop          the plain per-expert loop as one would write it: one gather, per expert
                x_e @ W13_e -> silu * up -> @ W2_e with each expert's weights its own tensors
                (as an nn.ModuleList holds them), torch.cat, weighted index_add; autograd does
                the backward
  loop_index_add
                the per-expert loop of issue 37: per expert, index_select its tokens' rows of x, SwiGLU,
                and index_add_ the weighted rows into the output (no permute, no concatenation); each
                expert's weights its own tensors; autograd does the backward
  reference     (--reference) autograd through optimus.kernels.reference, stacked weights sliced
                per expert: slow, its backward zero-fills whole weight stacks once per expert
  moe_layer     the whole optimus.model.moe.MoE layer, router included (its own routing)
  triton        the triton backend (GPU only)
  hf_eager, hf_grouped_mm, torchtitan
                (--peers) other libraries' expert paths on the same weights, tokens and routing, each checked
                against Optimus's output and gradients first (see benchmarks/moe_peers.py)
  dense         the roofline: one dense [A, D] x [D, 3F] linear fwd+bwd (dx and dW), same FLOPs.
                For 16-bit dtypes on a CPU without 16-bit matmul units it is measured two ways and
                the faster is the roofline: `dense` (16-bit-rounded operands, fp32 GEMM: what the
                torch backend does there) and `dense_native` (torch's own 16-bit matmul, A/8 rows).

bf16 means training's mixed precision as `optimus train` runs it with train.dtype=bf16: bf16 weights and
activations under torch.autocast(bf16) (the fp32 master copy lives in the optimizer). `--fp32-params` keeps
fp32 weights and activations under autocast instead, as the issue-22 table was measured: every method then
also pays for casting its weights to bf16 and its weight gradients back every step.
Routing is random top-k (each token picks K distinct experts uniformly), drawn anew for every
iteration, warm-up included, as a training step routes anew: the experts' row counts change from
one iteration to the next (on a CPU, oneDNN builds a kernel for each new 16-bit GEMM shape, which
a benchmark repeating one routing never pays; `--same-routing` repeats one). Methods are timed
round-robin (one iteration of each in turn, order rotated) so that load from other processes
hits all of them alike; the figure is the median.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from moe_peers import peer_steps  # benchmarks/ is the script's directory, first on sys.path

from optimus.cpu_runtime import keep_cpu_allocations
from optimus.kernels import get_backend, gpu_present, reference
from optimus.kernels.dtypes import math_dtype

SHAPES = {
    "S1": dict(T=4096, D=512, F=1024, E=8, K=2),
    "S2": dict(T=4096, D=512, F=256, E=64, K=8),
    # Not tuned for: other widths, expert counts and top-k, smaller batches.
    "U1": dict(T=2048, D=768, F=384, E=16, K=4),
    "U2": dict(T=1024, D=1024, F=2048, E=4, K=1),
    "U3": dict(T=8192, D=256, F=128, E=128, K=6),
}
QUICK_SHAPES = ("S1", "S2")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def expert_flops(T, D, F, E, K) -> float:
    return 6.0 * (T * K) * D * 3 * F


def autocast(device: str, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype)


class Routings:
    """One routing per call, each drawn anew (the same one every call with `same`): (token_idx_A, weight_A
    leaf, offsets_E)."""

    def __init__(self, s, device, gen, same: bool):
        self.s, self.device, self.gen, self.same, self.last = s, device, gen, same, None

    def __call__(self):
        if self.last is None or not self.same:
            token_idx_A, weight_A, offsets_E = reference.random_routing(self.s["T"], self.s["E"], self.s["K"], self.gen)
            weight_A = weight_A.to(self.device).requires_grad_()
            self.last = token_idx_A.to(self.device), weight_A, offsets_E.to(self.device)
        return self.last


def make_problem(s, device, gen, same_routing, param_dtype):
    """Routings, leaves in `param_dtype` and an output gradient for one shape."""
    T, D, F, E = s["T"], s["D"], s["F"], s["E"]
    routings = Routings(s, device, gen, same_routing)
    x_TD = torch.randn(T, D, generator=gen).to(device, param_dtype).requires_grad_()
    w13_EDF2 = (torch.randn(E, D, 2 * F, generator=gen) / D**0.5).to(device, param_dtype).requires_grad_()
    w2_EFD = (torch.randn(E, F, D, generator=gen) / F**0.5).to(device, param_dtype).requires_grad_()
    dout_TD = torch.randn(T, D, generator=gen).to(device, param_dtype)
    return x_TD, routings, w13_EDF2, w2_EFD, dout_TD


def ops_forward_backward(ops, problem, s, dtype, device):
    """routing -> (out [T, D], grads of x, the routing weights, W13 and W2): permute -> expert_swiglu_mlp ->
    combine, forward+backward, on `problem`'s leaves (x, W13, W2, the output gradient)."""
    x_TD, w13, w2, dout_TD = problem

    def forward_backward(routing):
        token_idx_A, weight_A, offsets_E = routing
        with autocast(device, dtype):
            x_AD = ops.permute(x_TD, token_idx_A)
            y_AD = ops.expert_swiglu_mlp(x_AD, w13, w2, offsets_E)
            out_TD = ops.combine(y_AD, token_idx_A, weight_A, s["T"])
        return out_TD, torch.autograd.grad(out_TD, (x_TD, weight_A, w13, w2), dout_TD.to(out_TD.dtype))

    return forward_backward


def make_ops_step(ops, s, dtype, device, gen, same_routing, param_dtype):
    """permute -> expert_swiglu_mlp -> combine, forward+backward."""
    x_TD, routings, w13, w2, dout_TD = make_problem(s, device, gen, same_routing, param_dtype)
    forward_backward = ops_forward_backward(ops, (x_TD, w13, w2, dout_TD), s, dtype, device)
    return lambda: forward_backward(routings())


def loop_problem(s, device, gen, same_routing, param_dtype):
    """make_problem's, with each expert's weights leaves of their own (as an nn.ModuleList of experts holds them)."""
    x_TD, routings, w13, w2, dout_TD = make_problem(s, device, gen, same_routing, param_dtype)
    separate = [[w.detach().clone().requires_grad_() for w in stack] for stack in (w13, w2)]
    return x_TD, routings, *separate, dout_TD


def make_loop_step(s, dtype, device, gen, same_routing, param_dtype):
    """The plain per-expert loop, each expert's weights separate leaves (an nn.ModuleList of experts)."""
    x_TD, routings, w13_list, w2_list, dout_TD = loop_problem(s, device, gen, same_routing, param_dtype)
    n_ffn = s["F"]

    def step():
        token_idx_A, weight_A, offsets_E = routings()
        counts = torch.diff(offsets_E.cpu(), prepend=torch.zeros(1, dtype=offsets_E.dtype)).tolist()
        with autocast(device, dtype):
            ys = []
            for x_RD, w13_e, w2_e in zip(x_TD[token_idx_A].split(counts), w13_list, w2_list):
                h_RF2 = x_RD @ w13_e
                ys.append((F.silu(h_RF2[:, :n_ffn]) * h_RF2[:, n_ffn:]) @ w2_e)
            y_AD = torch.cat(ys) * weight_A.unsqueeze(1)
            out_TD = y_AD.new_zeros(s["T"], s["D"]).index_add(0, token_idx_A, y_AD)
        torch.autograd.grad(out_TD, (x_TD, weight_A, *w13_list, *w2_list), dout_TD.to(out_TD.dtype))

    return step


def make_loop_index_add_step(s, dtype, device, gen, same_routing, param_dtype):
    """Issue 37's plain loop: per expert, index_select its rows of x, SwiGLU, index_add_ the weighted rows back."""
    x_TD, routings, w13_list, w2_list, dout_TD = loop_problem(s, device, gen, same_routing, param_dtype)
    n_ffn = s["F"]

    def step():
        token_idx_A, weight_A, offsets_E = routings()
        bounds = [0, *offsets_E.tolist()]
        with autocast(device, dtype):
            out_TD = None
            for e, (w13_e, w2_e) in enumerate(zip(w13_list, w2_list)):
                lo, hi = bounds[e], bounds[e + 1]
                idx_R = token_idx_A[lo:hi]
                h_RF2 = x_TD.index_select(0, idx_R) @ w13_e
                y_RD = (F.silu(h_RF2[:, :n_ffn]) * h_RF2[:, n_ffn:]) @ w2_e
                if out_TD is None:
                    out_TD = y_RD.new_zeros(s["T"], s["D"])
                out_TD.index_add_(0, idx_R, y_RD * weight_A[lo:hi, None].to(y_RD.dtype))
        torch.autograd.grad(out_TD, (x_TD, weight_A, *w13_list, *w2_list), dout_TD.to(out_TD.dtype))

    return step


def make_dense_step(s, dtype, device, gen, param_dtype, native: bool, row_fraction: int = 1):
    """One dense [A, D] x [D, 3F] linear, fwd + bwd (dx, dW): the equal-FLOP GEMM roofline."""
    A = s["T"] * s["K"] // row_fraction
    D, N = s["D"], 3 * s["F"]
    x = torch.randn(A, D, generator=gen).to(device, param_dtype).requires_grad_()
    w = (torch.randn(D, N, generator=gen) / D**0.5).to(device, param_dtype).requires_grad_()
    dy = torch.randn(A, N, generator=gen).to(device, param_dtype)
    math = math_dtype(dtype, torch.device(device))

    def step():
        if native or math == dtype:
            with autocast(device, dtype):
                y = x @ w
        else:  # 16-bit-rounded operands, fp32 GEMM (products of 16-bit values are exact in fp32)
            y = (x.to(dtype).to(math) @ w.to(dtype).to(math)).to(dtype)
        torch.autograd.grad(y, (x, w), dy.to(y.dtype))

    return step


def make_moe_step(s, dtype, device, gen, same_routing, param_dtype):
    from optimus.config import MoEConfig
    from optimus.model.moe import layer

    T, D, F, E, K = s["T"], s["D"], s["F"], s["E"], s["K"]
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    # Router losses weighted 1: their gradients ride on the backward of y.
    moe_cfg = MoEConfig(n_experts=E, top_k=K, expert_dim=F, aux_loss_coef=1.0, z_loss_coef=1.0)
    moe = layer.MoE(D, moe_cfg, kernels="torch").to(device, param_dtype)
    for p in moe.parameters():  # the layer leaves initialisation to the model
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, T, D, generator=gen).to(device, param_dtype).requires_grad_()
    dout = torch.randn(1, T, D, generator=gen).to(device, param_dtype)
    params = [x, *moe.parameters()]
    router_weight = moe.router.gate.weight if hasattr(moe.router, "gate") else None

    def step():
        if router_weight is not None and not same_routing:  # a training step's update: the routing changes
            with torch.no_grad():
                router_weight.normal_(std=0.02, generator=gen)
        with autocast(device, dtype):
            y = moe(x)
        loss_terms = (y * dout.to(y.dtype)).float().sum()
        torch.autograd.grad(loss_terms, params, allow_unused=True)

    return step


def time_round_robin(steps: dict, iters: int, warmup: int, clock=time.perf_counter) -> dict:
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    names = list(steps)
    for i in range(iters):
        # Rotate the order so no method is always the one that runs after the largest frees.
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = clock()
            steps[name]()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def case_steps(s, dtype, device, with_reference, same_routing=False, fp32_params=False, peers=False):
    """The methods to time for one shape and dtype, the row fraction each one computes, and why a peer asked
    for has no column."""
    gen = torch.Generator().manual_seed(0)
    torch_ops = get_backend("torch")
    param_dtype = torch.float32 if fp32_params else dtype
    common = (s, dtype, device, gen, same_routing, param_dtype)
    steps = {
        "optimus": make_ops_step(torch_ops, *common),
        "loop": make_loop_step(*common),
        "loop_index_add": make_loop_index_add_step(*common),
        "moe_layer": make_moe_step(*common),
        "dense": make_dense_step(s, dtype, device, gen, param_dtype, native=False),
    }
    scale = {}
    if device != "cpu":
        steps["triton"] = make_ops_step(get_backend("triton"), *common)
    if with_reference:
        steps["reference"] = make_ops_step(reference, *common)
    if math_dtype(dtype, torch.device(device)) != dtype:
        steps["dense_native"] = make_dense_step(s, dtype, device, gen, param_dtype, native=True, row_fraction=8)
        scale["dense_native"] = 8
    missing = {}
    if peers:
        x_TD, routings, w13, w2, dout_TD = make_problem(s, device, gen, same_routing, param_dtype)
        problem = (x_TD, w13, w2, dout_TD)
        optimus = ops_forward_backward(torch_ops, problem, s, dtype, device)
        found, missing = peer_steps(problem, routings, optimus, s, dtype, device, lambda: autocast(device, dtype))
        steps.update(found)
    return steps, scale, missing


def run_case(name, s, dtype_name, args):
    flops = expert_flops(**s)
    steps, scale, missing = case_steps(
        s, DTYPES[dtype_name], args.device, args.reference, args.same_routing, args.fp32_params, args.peers
    )
    if args.methods:  # the roofline is always timed
        keep = set(args.methods.split(","))
        steps = {m: step for m, step in steps.items() if m in keep or m.startswith("dense")}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    medians = time_round_robin(steps, args.iters, args.warmup, clock)
    rows = {}
    for method, t in medians.items():
        rows[method] = {"seconds": t, "gflops_per_s": flops / scale.get(method, 1) / t / 1e9}
    roofline = max(rows[m]["gflops_per_s"] for m in rows if m.startswith("dense"))
    for r in rows.values():
        r["of_roofline"] = r["gflops_per_s"] / roofline
    case = {"shape": name, "dtype": dtype_name, **s, "expert_gflop": flops / 1e9, "roofline_gflops_per_s": roofline}
    if missing:
        case["peers_missing"] = missing
    return case, rows


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|amx[a-z_0-9]*)\b", cpuinfo)))
    model = re.search(r"model name\s*:\s*(.*)", cpuinfo)
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": model.group(1) if model else platform.processor() or platform.machine(),
        "cpu_flags": flags,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


METHOD_ORDER = (
    "optimus", "loop", "loop_index_add", "reference", "triton", "hf_eager", "hf_grouped_mm", "torchtitan",
    "moe_layer", "dense", "dense_native",
)  # fmt: skip


def markdown_table(results) -> str:
    methods = [m for m in METHOD_ORDER if any(m in rows for _, rows in results)]
    lines = [
        "| shape (T D F E K) | dtype | roofline GFLOP/s | " + " | ".join(methods) + " |",
        "|---|---|---:|" + "---:|" * len(methods),
    ]
    for case, rows in results:
        dims = " ".join(str(case[k]) for k in "TDFEK")
        cells = [f"{rows[m]['of_roofline']:.2f}" if m in rows else "" for m in methods]
        head = f"| {case['shape']} ({dims}) | {case['dtype']} | {case['roofline_gflops_per_s']:.0f} | "
        lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help=f"{','.join(QUICK_SHAPES)} only, 3 iterations")
    parser.add_argument("--reference", action="store_true", help="also time the stacked-weight reference (slow)")
    parser.add_argument("--device", default="cuda" if gpu_present() and torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/moe_layer_<device>.json)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    clock_help = "wall: elapsed time; cpu: this process's CPU time, steadier on a loaded machine with --threads 1"
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help=clock_help)
    parser.add_argument("--default-malloc", action="store_true", help="skip keep_cpu_allocations (what training does)")
    parser.add_argument("--same-routing", action="store_true", help="repeat one routing in every iteration")
    parser.add_argument("--peers", action="store_true", help="also time transformers' and torchtitan's expert paths")
    parser.add_argument("--methods", default=None, help="comma-separated methods to time (default: all; dense always)")
    parser.add_argument("--fp32-params", action="store_true", help="fp32 weights, bf16 autocast (issue 22 table)")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.iters = ",".join(QUICK_SHAPES), 3
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}: choose from {', '.join(SHAPES)}.")
    return args


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = args.device == "cpu" and not args.default_malloc and keep_cpu_allocations()
    meta = {**machine(), "command": " ".join(["python", *sys.argv]), "iters": args.iters, "clock": args.clock}
    meta["routing"] = "the same in every iteration" if args.same_routing else "drawn anew for every iteration"
    meta["malloc_kept"] = kept
    meta["params"] = "fp32" if args.fp32_params else "the compute dtype"
    meta["load_average_before"] = os.getloadavg()
    print(json.dumps(meta))
    print("figures: fraction of the roofline (a dense GEMM fwd+bwd of the same FLOPs)\n")
    results = []
    for name in args.shapes.split(","):
        for dtype_name in args.dtypes.split(","):
            results.append(run_case(name, SHAPES[name], dtype_name, args))
            print(markdown_table(results[-1:]).splitlines()[-1], flush=True)
            for peer, why in results[-1][0].get("peers_missing", {}).items():
                print(f"  {peer}: no column, {why}")
    meta["load_average_after"] = os.getloadavg()
    print("\n" + markdown_table(results))
    print(f"\nload average before {meta['load_average_before']}, after {meta['load_average_after']}")
    out = Path(args.out or Path(__file__).parent / "results" / f"moe_layer_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "results": [{**case, "methods": rows} for case, rows in results]}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
