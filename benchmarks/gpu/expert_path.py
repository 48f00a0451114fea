"""The expert path on one device, per kernel backend: checked against the plain-PyTorch reference, then timed.

    python benchmarks/gpu/expert_path.py                          # on a GPU: every shape, bf16
    python benchmarks/gpu/expert_path.py --tiny                   # no GPU: tiny shapes, fp32, TRITON_INTERPRET=1
    python benchmarks/gpu/expert_path.py --shapes mula-7b-a1b --iters 50

Methods (rows of the table):
  triton      the triton backend's permute -> expert_swiglu_mlp -> combine (`kernels=triton`)
  torch       the torch backend's, whose expert GEMMs are torch's grouped GEMM (F.grouped_mm /
              torch._grouped_mm) on a GPU in bf16 (`kernels=torch`); the JSON says which GEMM ran
  loop        a plain per-expert loop (index_select, x_e @ W13_e, SwiGLU, @ W2_e, index_add), autograd backward
  dense       the roofline: one dense [A, D] x [D, 3F] linear with the expert GEMMs' FLOPs (A = T*K rows)

Each method first computes the output and the gradients of x, the routing weights, W13 and W2 on one routing
and compares them with `optimus.kernels.reference` run in fp32 on the same (rounded) leaves: the relative
error ||got - ref|| / ||ref|| of each must stay under the dtype's tolerance (bf16 2e-2: a bf16 rounding of
each GEMM operand and of the output, 2^-8 = 3.9e-3 per rounding, grown over the sums; fp32 1e-2 on a GPU,
where Triton's tl.dot and torch's grouped GEMM may run fp32 as TF32, 2^-11 = 4.9e-4 per operand, and 1e-4 on
a CPU). A method that fails its check is reported and not timed.

Timing: `iters` calls, after `warmup`, each on one of four routings drawn beforehand (the experts' row counts
change from call to call, as in training), issued back to back and timed with device events read after the
last (the host clock on a CPU); the figure is the median. FLOPs counted: the expert GEMMs only, 2*A*D*3F
forward and twice that backward. `forward` is the forward with autograd recording (what training runs);
`fwd+bwd` adds the gradients of every leaf.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = {
    # One Mula MoE layer with every expert on one device and 8192 tokens (4 sequences of 2048)
    "mula-7b-a1b": dict(T=8192, D=2048, F=1024, E=64, K=8),
    "mula-100b-a7b": dict(T=8192, D=3072, F=1536, E=144, K=8),
    # benchmarks/moe_layer.py's CPU-tuned shapes, for comparison with its CPU results: launch-bound on a GPU (under
    # 0.15 of dense on an H200), and each new width costs Triton a compile and an autotuning of every kernel: last
    "S1": dict(T=4096, D=512, F=1024, E=8, K=2),
    "S2": dict(T=4096, D=512, F=256, E=64, K=8),
}
TINY_SHAPES = {
    "tiny": dict(T=48, D=24, F=40, E=4, K=2),  # no dimension a multiple of the 16-wide tiles
    "tiny-empty": dict(T=17, D=16, F=20, E=6, K=1),  # a routing that leaves experts empty
}
TOLERANCE = {("gpu", "bf16"): 2e-2, ("gpu", "fp32"): 1e-2, ("cpu", "fp32"): 1e-4, ("cpu", "bf16"): 2e-2}
N_ROUTINGS = 4

if "--tiny" in sys.argv and os.environ.get("TRITON_INTERPRET") is None:
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from optimus.kernels import get_backend, reference, torch_backend  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GRAD_NAMES = ("out", "dx", "dweight", "dw13", "dw2")


def expert_flops(s: dict, backward: bool) -> float:
    forward = 2.0 * s["T"] * s["K"] * s["D"] * 3 * s["F"]
    return 3 * forward if backward else forward


def make_leaves(s: dict, device: str, dtype: torch.dtype, gen: torch.Generator):
    """x [T, D], W13 [E, D, 2F], W2 [E, F, D] (leaves in `dtype`), the output gradient [T, D], and
    `N_ROUTINGS` routings (token_idx_A, weight_A leaf in fp32, offsets_E) on the device."""
    T, D, Fd, E, K = (s[k] for k in "TDFEK")
    x_TD = torch.randn(T, D, generator=gen).to(device, dtype).requires_grad_()
    w13_EDF2 = (torch.randn(E, D, 2 * Fd, generator=gen) / D**0.5).to(device, dtype).requires_grad_()
    w2_EFD = (torch.randn(E, Fd, D, generator=gen) / Fd**0.5).to(device, dtype).requires_grad_()
    dout_TD = torch.randn(T, D, generator=gen).to(device, dtype)
    routings = []
    for i in range(N_ROUTINGS):
        empty = tuple(range(0, E, 3)) if T < 64 and E - len(range(0, E, 3)) >= K else ()
        token_idx_A, weight_A, offsets_E = reference.random_routing(T, E, K, gen, empty_experts=empty if i else ())
        routings.append((token_idx_A.to(device), weight_A.to(device).requires_grad_(), offsets_E.to(device)))
    return (x_TD, w13_EDF2, w2_EFD, dout_TD), routings


def ops_step(ops, leaves, n_tokens: int, backward: bool):
    x_TD, w13, w2, dout_TD = leaves

    def step(routing):
        token_idx_A, weight_A, offsets_E = routing
        x_AD = ops.permute(x_TD, token_idx_A)
        y_AD = ops.expert_swiglu_mlp(x_AD, w13, w2, offsets_E)
        out_TD = ops.combine(y_AD, token_idx_A, weight_A, n_tokens)
        if not backward:
            return (out_TD,)
        return (out_TD, *torch.autograd.grad(out_TD, (x_TD, weight_A, w13, w2), dout_TD.to(out_TD.dtype)))

    return step


def loop_step(leaves, n_tokens: int, backward: bool):
    """The per-expert loop as one writes it without grouped kernels; row bounds read on the host, as such a loop
    must."""
    x_TD, w13, w2, dout_TD = leaves
    n_ffn = w2.shape[1]

    def step(routing):
        token_idx_A, weight_A, offsets_E = routing
        bounds = [0, *offsets_E.tolist()]
        out_TD = x_TD.new_zeros(n_tokens, x_TD.shape[1])
        for e, (w13_DF2, w2_FD) in enumerate(zip(w13.unbind(0), w2.unbind(0))):
            lo, hi = bounds[e], bounds[e + 1]
            if hi == lo:
                continue
            idx_R = token_idx_A[lo:hi]
            h_RF2 = x_TD.index_select(0, idx_R) @ w13_DF2
            y_RD = (F.silu(h_RF2[:, :n_ffn]) * h_RF2[:, n_ffn:]) @ w2_FD
            out_TD = out_TD.index_add(0, idx_R, y_RD * weight_A[lo:hi, None].to(y_RD.dtype))
        if not backward:
            return (out_TD,)
        return (out_TD, *torch.autograd.grad(out_TD, (x_TD, weight_A, w13, w2), dout_TD.to(out_TD.dtype)))

    return step


def dense_step(s: dict, device: str, dtype: torch.dtype, gen: torch.Generator, backward: bool):
    A, D, N = s["T"] * s["K"], s["D"], 3 * s["F"]
    x = torch.randn(A, D, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(D, N, generator=gen) / D**0.5).to(device, dtype).requires_grad_()
    dy = torch.randn(A, N, generator=gen).to(device, dtype)

    def step(_routing):
        y = x @ w
        return (y, *torch.autograd.grad(y, (x, w), dy)) if backward else (y,)

    return step


def relative_errors(step, routing, leaves) -> dict:
    """Each of `step`'s outputs against the fp32 reference on the same leaves: ||got - ref|| / ||ref||."""
    got = step(routing)
    leaves32 = [t.detach().float().requires_grad_() for t in leaves[:3]] + [leaves[3].float()]
    routing32 = (routing[0], routing[1].detach().float().requires_grad_(), routing[2])
    want = ops_step(reference, leaves32, leaves[0].shape[0], backward=True)(routing32)
    errors = {}
    for name, g, w in zip(GRAD_NAMES, got, want):
        denom = w.norm().item()
        err = (g.float() - w).norm().item() / denom if denom else (g.float() - w).norm().item()
        errors[name] = err if err == err else float("inf")  # NaN fails
    return errors


def which_gemm(device: str, dtype: torch.dtype, n_experts: int) -> str:
    """The GEMM the torch backend runs for these operands (torch_backend._use_grouped's rule)."""
    probe = torch.empty(16, 16, device=device, dtype=dtype)  # aligned, as the step's tensors are
    grouped = torch_backend._use_grouped(n_experts, probe)
    return "grouped_mm" if grouped else "per-expert torch.mm loop"


def time_step(step, routings, iters: int, warmup: int, device: str) -> float:
    """The median seconds of `step`: device events around each call, read after the last (no host wait between
    calls, as in training), or the host clock on a CPU."""
    for i in range(warmup):
        step(routings[i % len(routings)])
    if device == "cpu":
        times = []
        for i in range(iters):
            t0 = time.perf_counter()
            step(routings[i % len(routings)])
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    api = torch.get_device_module(device)
    api.synchronize()
    events = []
    for i in range(iters):
        start, end = api.Event(enable_timing=True), api.Event(enable_timing=True)
        start.record()
        step(routings[i % len(routings)])
        end.record()
        events.append((start, end))
    api.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3  # elapsed_time: ms


def run_case(name: str, s: dict, dtype_name: str, args) -> dict:
    device, dtype = args.device, DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(0)
    leaves, routings = make_leaves(s, device, dtype, gen)
    tolerance = TOLERANCE[("cpu" if device == "cpu" else "gpu", dtype_name)]
    makers = {
        "triton": lambda bw: ops_step(get_backend("triton"), leaves, s["T"], bw),
        "torch": lambda bw: ops_step(get_backend("torch"), leaves, s["T"], bw),
        "loop": lambda bw: loop_step(leaves, s["T"], bw),
    }
    case = {"shape": name, "dtype": dtype_name, **s, "tolerance": tolerance, "methods": {}}
    case["torch_backend_gemm"] = which_gemm(device, dtype, s["E"])
    for method in args.methods.split(","):
        row = {}
        try:
            row["errors"] = relative_errors(makers[method](True), routings[1], leaves)
            row["correct"] = all(e <= tolerance for e in row["errors"].values())
            if row["correct"]:
                for label, backward in (("forward", False), ("fwd+bwd", True)):
                    seconds = time_step(makers[method](backward), routings, args.iters, args.warmup, device)
                    row[label] = {"seconds": seconds, "tflops": expert_flops(s, backward) / seconds / 1e12}
        except Exception as e:  # a backend that cannot run here is a row that says why, not a lost table
            row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        case["methods"][method] = row
    for label, backward in (("forward", False), ("fwd+bwd", True)):
        seconds = time_step(dense_step(s, device, dtype, gen, backward), routings, args.iters, args.warmup, device)
        case["methods"].setdefault("dense", {})[label] = {
            "seconds": seconds,
            "tflops": expert_flops(s, backward) / seconds / 1e12,
        }
    return case


def cell(case: dict, method: str, label: str) -> str:
    row = case["methods"].get(method, {})
    if "failed" in row:
        return "failed"
    if row.get("correct") is False:
        return "WRONG"
    if label not in row:
        return ""
    roofline = case["methods"]["dense"][label]["tflops"]
    return f"{row[label]['tflops']:.3g} ({row[label]['tflops'] / roofline:.2f})"


def markdown(cases: list[dict], methods: list[str]) -> str:
    cols = [f"{m} {label}" for m in [*methods, "dense"] for label in ("forward", "fwd+bwd")]
    lines = ["| shape (T D F E K) | dtype | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for case in cases:
        dims = " ".join(str(case[k]) for k in "TDFEK")
        cells = [cell(case, m, label) for m in [*methods, "dense"] for label in ("forward", "fwd+bwd")]
        lines.append(f"| {case['shape']} ({dims}) | {case['dtype']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 shapes, the Triton interpreter (no GPU)")
    parser.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default=None, help="comma-separated, of bf16, fp32 (default bf16; --tiny fp32)")
    parser.add_argument("--methods", default="triton,torch,loop")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per method (default 20; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    args.device = "cpu" if args.tiny else accelerator()
    shapes = TINY_SHAPES if args.tiny else SHAPES
    args.shapes = args.shapes or ",".join(shapes)
    args.dtypes = args.dtypes or ("fp32" if args.tiny else "bf16")
    args.iters = args.iters or (2 if args.tiny else 20)
    args.warmup = 1 if args.tiny else args.warmup
    unknown = [s for s in args.shapes.split(",") if s not in shapes]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}: choose from {', '.join(shapes)}.")
    if args.device is None:
        parser.error("no GPU is visible: run with --tiny here (the Triton interpreter on tiny shapes).")
    return args, shapes


def accelerator() -> str | None:
    """cuda (NVIDIA or AMD) or xpu (Intel), whichever torch sees; None without either."""
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    return "xpu" if xpu is not None and xpu.is_available() else None


def main() -> int:
    args, shapes = parse_args()
    cases = []
    for name in args.shapes.split(","):
        for dtype_name in args.dtypes.split(","):
            cases.append(run_case(name, shapes[name], dtype_name, args))
            print(markdown(cases[-1:], args.methods.split(",")).splitlines()[-1], flush=True)
    table = markdown(cases, args.methods.split(","))
    print("\nTFLOP/s (fraction of the dense GEMM of the same FLOPs, same run)\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "cases": cases}, indent=2) + "\n")
    wrong = [
        f"{c['shape']} {c['dtype']} {m}: {max(r['errors'], key=r['errors'].get)} off by "
        f"{max(r['errors'].values()):.2e} (tolerance {c['tolerance']:.0e})"
        for c in cases
        for m, r in c["methods"].items()
        if r.get("correct") is False
    ]
    for line in wrong:
        print(f"WRONG: {line}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
