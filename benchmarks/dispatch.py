"""Expert-parallel token dispatch on this machine: bytes each rank sends, dispatch + combine time, overlap.

    python benchmarks/dispatch.py [--tokens 4096] [--dim 512] [--experts 16] [--top-k 2] [--ranks 2 4]
    python benchmarks/dispatch.py --parts overlap [--overlap-tokens 2048] [--overlap-dim 256] [--expert-dim 64]

Part `movement`: for each dispatcher (alltoall, allgather) and EP size, one MoE layer's
dispatch and combine run on gloo ranks started by optimus.local_launcher.spawn_local (the path of
`optimus train parallel.nproc=N`). The experts are the identity, so the time is the
token movement alone (permute, collectives, regroup, combine); the local dispatcher
at 1 rank is the baseline. Bytes are counted at the collectives, per rank, for one
forward pass of one layer on one micro-batch (the backward sends the same again):

    payload   token rows (and partial sums) sent to other ranks
    metadata  counts, expert ids, routing weights
    minimum   2 x (assignments routed to another rank) x dim x bytes: every remote
              (token, expert) pair out and back, nothing for what stays local
    dedup     2 x (distinct (token, remote rank) pairs) x dim x bytes: the floor
              if a token is sent once per destination rank and combined there

Part `overlap`: how much of the all-to-all exchange the overlapped dispatcher hides
(parallel.ep_overlap_chunks, shared experts computed while tokens travel), on
`--overlap-ranks` gloo ranks with real grouped SwiGLU experts and one shared expert,
forward + backward of one layer. Timed: the four row exchanges alone (out and back,
forward and backward), the local experts alone, the shared expert alone, the serial
paths (one chunk, shared experts after the exchange as before the overlap existed)
and the overlapped ones; hidden = (serial - overlapped) / exchange. The variants run
in turn within every round (the order rotating), each round's time is the slowest
rank's, and the figures are medians over rounds.

Routing is a real softmax router with random weights (roughly balanced). Results
are printed as tables and written to benchmarks/results/dispatch_cpu.json (a part not
run keeps what the file held).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import optimus.parallel.collectives as coll
from optimus.config import MoEConfig
from optimus.kernels import get_backend
from optimus.model.mlp import SwiGLU
from optimus.model.moe.dispatch import LocalDispatcher
from optimus.model.moe.experts import GroupedExperts
from optimus.model.moe.router import Router
from optimus.parallel.alltoall_dispatch import AllToAllDispatcher
from optimus.parallel.expert_parallel import DISPATCHER_CLASSES


class IdentityExperts(nn.Module):
    """Stands in for GroupedExperts: returns its rows, so only token movement is timed."""

    def __init__(self, n_local: int):
        super().__init__()
        self.n_experts = n_local
        self.kernels = get_backend("torch")
        self.w13 = nn.Parameter(torch.zeros(n_local, 1, 1))  # read only when a rank receives no rows
        self.w2 = nn.Parameter(torch.zeros(n_local, 1, 1))

    def forward(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return x_AD * 1.0


class ByteCounter:
    """Wraps the collectives' entry points and adds up the bytes this rank sends to other ranks."""

    def __init__(self, dim: int):
        self.dim, self.payload, self.metadata, self.on = dim, 0, 0, False
        self._a2a, self._ag, self._rs = dist.all_to_all_single, coll._all_gather_tensor, coll._reduce_scatter_tensor
        dist.all_to_all_single = self._all_to_all
        coll._all_gather_tensor = self._all_gather
        coll._reduce_scatter_tensor = self._reduce_scatter

    def _add(self, t: torch.Tensor, nbytes: float) -> None:
        if self.on:
            is_rows = t.is_floating_point() and t.dim() == 2 and t.shape[1] == self.dim
            if is_rows:
                self.payload += int(nbytes)
            else:
                self.metadata += int(nbytes)

    def _all_to_all(self, out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
        size, me = dist.get_world_size(group), dist.get_rank(group)
        rows = in_splits if in_splits is not None else [inp.shape[0] // size] * size
        row_bytes = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        self._add(inp, sum(n for j, n in enumerate(rows) if j != me) * row_bytes)
        return self._a2a(out, inp, out_splits, in_splits, group=group, async_op=async_op)

    def _all_gather(self, out, inp, group=None, async_op=False):
        self._add(inp, (dist.get_world_size(group) - 1) * inp.numel() * inp.element_size())
        return self._ag(out, inp, group=group, async_op=async_op)

    def _reduce_scatter(self, out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        size = dist.get_world_size(group)
        self._add(inp, (size - 1) / size * inp.numel() * inp.element_size())
        return self._rs(out, inp, op=op, group=group, async_op=async_op)


def remote_assignments(expert_idx_TK: torch.Tensor, n_local: int, ep: int, ep_rank: int) -> tuple[int, int]:
    """(assignments whose expert lives on another rank, distinct (token, other rank) pairs)."""
    dest_TK = expert_idx_TK // n_local
    token_idx, k_idx = torch.nonzero(dest_TK != ep_rank, as_tuple=True)
    pairs = torch.unique(token_idx * ep + dest_TK[token_idx, k_idx]).numel()
    return token_idx.numel(), pairs


def timed(fn, iters: int) -> float:
    """Median seconds of `fn` over `iters` runs, each started together on all ranks."""
    times = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_rank(args: argparse.Namespace, dispatcher_name: str) -> dict:
    """Body of one rank (also run alone for the local baseline)."""
    ep, rank = init_rank()
    dtype = getattr(torch, args.dtype)
    n_local = args.experts // ep
    torch.manual_seed(0)
    router = Router(args.dim, MoEConfig(n_experts=args.experts, top_k=args.top_k, expert_dim=1))
    gen = torch.Generator().manual_seed(100 + rank)
    x_TD = torch.randn(args.tokens, args.dim, generator=gen).to(dtype)
    with torch.no_grad():
        routing = router(x_TD.float())
    experts = IdentityExperts(n_local)
    if ep == 1:
        dispatcher = LocalDispatcher()
    else:
        dispatcher = DISPATCHER_CLASSES[dispatcher_name](dist.group.WORLD, ep, rank, n_local)

    counter = ByteCounter(args.dim)
    counter.on = True
    with torch.no_grad():
        y_TD = dispatcher(x_TD, routing, experts)
    counter.on = False
    # Identity experts: the output is the weighted sum of a token's own row.
    expected = x_TD.float() * routing.weight_TK.sum(1, keepdim=True)
    torch.testing.assert_close(y_TD.float(), expected, rtol=1e-2, atol=1e-2)

    x_grad = x_TD.clone().requires_grad_(True)

    def fwd_bwd():
        dispatcher(x_grad, routing, experts).backward(grad_out)

    grad_out = torch.randn_like(x_TD)
    with torch.no_grad():
        for _ in range(args.warmup):
            dispatcher(x_TD, routing, experts)
        fwd_s = timed(lambda: dispatcher(x_TD, routing, experts), args.iters)
    for _ in range(args.warmup):
        fwd_bwd()
    fwd_bwd_s = timed(fwd_bwd, args.iters)

    remote, pairs = remote_assignments(routing.expert_idx_TK, n_local, ep, rank) if ep > 1 else (0, 0)
    row_bytes = args.dim * x_TD.element_size()
    result = {
        "rank": rank, "payload_bytes": counter.payload, "metadata_bytes": counter.metadata,
        "min_bytes": 2 * remote * row_bytes, "dedup_min_bytes": 2 * pairs * row_bytes,
        "fwd_ms": 1e3 * fwd_s, "fwd_bwd_ms": 1e3 * fwd_bwd_s,
    }  # fmt: skip
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def init_rank():
    """(world size, rank) inside a spawned rank, with the gloo group up; one thread per rank."""
    from optimus.ranks import discover, init_process_group

    torch.set_num_threads(1)
    info = discover()
    if info.world_size > 1:
        init_process_group(info, "gloo", torch.device("cpu"), timeout_s=300)
    return info.world_size, info.rank


def overlap_variants(args: argparse.Namespace, ep: int, rank: int) -> dict:
    """{name: fn running one forward + backward}, every variant on the same tokens, routing and weights."""
    n_local = args.experts // ep
    torch.manual_seed(0)
    router = Router(args.overlap_dim, MoEConfig(n_experts=args.experts, top_k=args.top_k, expert_dim=1))
    experts = GroupedExperts(n_local, args.overlap_dim, args.expert_dim, kernels="torch")
    shared = SwiGLU(args.overlap_dim, args.expert_dim)
    with torch.no_grad():
        for w in experts.parameters():
            w.normal_(0, args.overlap_dim**-0.5)
    gen = torch.Generator().manual_seed(100 + rank)
    x_TD = torch.randn(args.overlap_tokens, args.overlap_dim, generator=gen).requires_grad_(True)
    grad_TD = torch.randn(args.overlap_tokens, args.overlap_dim, generator=gen)
    with torch.no_grad():
        routing = router(x_TD)
    one, two = (AllToAllDispatcher(dist.group.WORLD, ep, rank, n_local, chunks=c) for c in (1, 2))

    # The exchanges and the experts alone, on the rows the one-chunk path sends and receives.
    (chunk,) = one.plan(routing)
    x_AD = experts.kernels.permute(x_TD.detach(), chunk.assign.token_idx_A).requires_grad_(True)
    with torch.no_grad():
        x_RD = coll.all_to_all(x_AD, chunk.recv_rows, chunk.send_rows, dist.group.WORLD).requires_grad_(True)

    def exchange():
        rows = coll.all_to_all(x_AD, chunk.recv_rows, chunk.send_rows, dist.group.WORLD)
        coll.all_to_all(rows, chunk.send_rows, chunk.recv_rows, dist.group.WORLD).backward(x_AD.detach())

    def layer(dispatcher, with_shared, overlap):
        def run():
            if not with_shared:
                y_TD = dispatcher(x_TD, routing, experts)
            elif overlap:
                y_TD = dispatcher(x_TD, routing, experts, shared=shared)
            else:  # the MoE layer before the overlap: shared experts after the routed ones
                y_TD = dispatcher(x_TD, routing, experts) + shared(x_TD)
            y_TD.backward(grad_TD)

        return run

    with torch.no_grad():  # the overlapped paths compute what the serial one does
        serial_TD = one(x_TD, routing, experts) + shared(x_TD)
        torch.testing.assert_close(two(x_TD, routing, experts, shared=shared), serial_TD, rtol=1e-5, atol=1e-5)
    return {
        "exchange": exchange,
        "experts": lambda: one.run_local_experts(experts, x_RD, chunk.recv_counts_PL).backward(x_RD.detach()),
        "shared": lambda: shared(x_TD).backward(grad_TD),
        "serial": layer(one, False, False),
        "chunks=2": layer(two, False, True),
        "serial+shared": layer(one, True, False),
        "shared, chunks=1": layer(one, True, True),
        "shared, chunks=2": layer(two, True, True),
    }


# (configuration, its serial variant, its overlapped variant)
OVERLAP_CONFIGS = [
    ("routed experts, 2 chunks", "serial", "chunks=2"),
    ("+ shared expert, 1 chunk", "serial+shared", "shared, chunks=1"),
    ("+ shared expert, 2 chunks", "serial+shared", "shared, chunks=2"),
]


def bench_overlap_rank(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of every variant in every round, on this rank."""
    ep, rank = init_rank()
    variants = overlap_variants(args, ep, rank)
    for fn in variants.values():
        for _ in range(args.warmup):
            fn()
    names, times = list(variants), {name: [] for name in variants}
    for i in range(args.iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order every round
            dist.barrier()
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    dist.destroy_process_group()
    return times


def summarize_overlap(ep: int, per_rank: list[dict[str, list[float]]]) -> dict:
    """Median over rounds of the slowest rank's time, per variant; hidden fraction per configuration, from
    the medians and, as a measure of the noise, its quartiles over the rounds (each round's own ratio)."""
    rounds = {name: [max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name]))] for name in per_rank[0]}
    ms = {name: 1e3 * statistics.median(times) for name, times in rounds.items()}
    configs = []
    for config, serial, overlapped in OVERLAP_CONFIGS:
        per_round = [(s - o) / e for s, o, e in zip(rounds[serial], rounds[overlapped], rounds["exchange"])]
        q1, _, q3 = statistics.quantiles(per_round, n=4)
        configs.append(
            {"config": config, "serial_ms": ms[serial], "overlapped_ms": ms[overlapped],
             "hidden": (ms[serial] - ms[overlapped]) / ms["exchange"], "hidden_quartiles": [q1, q3]}
        )  # fmt: skip
    return {"ranks": ep, "variants_ms": ms, "configs": configs}


def print_overlap(result: dict) -> None:
    ms = result["variants_ms"]
    print(
        f"{result['ranks']} ranks, forward + backward, ms (median of the slowest rank): exchange alone "
        f"{ms['exchange']:.2f}, routed experts alone {ms['experts']:.2f}, shared expert alone {ms['shared']:.2f}\n"
    )
    print(f"{'configuration':<28} {'serial ms':>10} {'overlapped ms':>14} {'hidden':>7} {'per round, q1-q3':>17}")
    print("-" * 80)
    for c in result["configs"]:
        q1, q3 = c["hidden_quartiles"]
        print(
            f"{c['config']:<28} {c['serial_ms']:>10.2f} {c['overlapped_ms']:>14.2f} {c['hidden']:>7.2f} "
            f"{f'{q1:.2f} to {q3:.2f}':>17}"
        )


def machine() -> dict:
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f.startswith("avx512")})
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "avx512": flags,
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
    }


def summarize(dispatcher: str, ep: int, per_rank: list[dict]) -> dict:
    mean = lambda key: statistics.mean(r[key] for r in per_rank)
    row = {"dispatcher": dispatcher, "ranks": ep}
    for key in ("payload_bytes", "metadata_bytes", "min_bytes", "dedup_min_bytes"):
        row[key] = mean(key)
    row["payload_over_min"] = row["payload_bytes"] / row["min_bytes"] if row["min_bytes"] else None
    row["fwd_ms"] = max(r["fwd_ms"] for r in per_rank)  # the slowest rank sets the pace
    row["fwd_bwd_ms"] = max(r["fwd_bwd_ms"] for r in per_rank)
    return row


COLUMNS = [  # (header, width, format of one row)
    ("dispatcher", 10, lambda r: r["dispatcher"]),
    ("ranks", 5, lambda r: str(r["ranks"])),
    ("sent MB", 8, lambda r: f"{r['payload_bytes'] / 1e6:.2f}"),
    ("meta KB", 8, lambda r: f"{r['metadata_bytes'] / 1e3:.1f}"),
    ("min MB", 7, lambda r: f"{r['min_bytes'] / 1e6:.2f}"),
    ("dedup MB", 8, lambda r: f"{r['dedup_min_bytes'] / 1e6:.2f}"),
    ("sent/min", 8, lambda r: f"{r['payload_over_min']:.2f}" if r["payload_over_min"] else "-"),
    ("fwd ms", 8, lambda r: f"{r['fwd_ms']:.2f}"),
    ("fwd+bwd ms", 10, lambda r: f"{r['fwd_bwd_ms']:.2f}"),
]


def print_table(rows: list[dict]) -> None:
    align = ["<"] + [">"] * (len(COLUMNS) - 1)  # names left, numbers right
    head = " ".join(f"{name:{a}{width}}" for (name, width, _), a in zip(COLUMNS, align))
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(" ".join(f"{fmt(r):{a}{width}}" for (_, width, fmt), a in zip(COLUMNS, align)))


def run_movement(args: argparse.Namespace) -> dict:
    from optimus.local_launcher import spawn_local

    rows = [summarize("local", 1, [bench_rank(args, "local")])]
    for ep in args.ranks:
        for name in DISPATCHER_CLASSES:
            results = spawn_local(ep, bench_rank, (args, name))
            rows.append(summarize(name, ep, [results[r] for r in sorted(results)]))
    print(
        f"\nOne MoE layer, one micro-batch: {args.tokens} tokens/rank, dim {args.dim}, {args.experts} experts, "
        f"top-{args.top_k}, {args.dtype}; bytes sent per rank in the forward pass (backward: the same again)\n"
    )
    print_table(rows)
    keys = ("tokens", "dim", "experts", "top_k", "dtype", "warmup", "iters")
    return {"setup": {k: getattr(args, k) for k in keys}, "rows": rows}


def run_overlap(args: argparse.Namespace) -> dict:
    from optimus.local_launcher import spawn_local

    results = []
    for ep in args.overlap_ranks:
        per_rank = spawn_local(ep, bench_overlap_rank, (args,))
        results.append(summarize_overlap(ep, [per_rank[r] for r in sorted(per_rank)]))
        print(
            f"\nOverlap: {args.overlap_tokens} tokens/rank, dim {args.overlap_dim}, {args.experts} experts of "
            f"{args.expert_dim}, top-{args.top_k}, one shared expert, fp32; hidden = (serial - overlapped) / exchange"
        )
        print_overlap(results[-1])
    keys = ("overlap_tokens", "overlap_dim", "expert_dim", "experts", "top_k", "warmup", "iters")
    return {"setup": {k: getattr(args, k) for k in keys}, "results": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["movement", "overlap"], choices=["movement", "overlap"])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank per micro-batch")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--overlap-tokens", type=int, default=2048, help="tokens per rank (part overlap)")
    p.add_argument("--overlap-dim", type=int, default=256, help="model dim (part overlap)")
    p.add_argument("--expert-dim", type=int, default=64, help="hidden dim of each expert (part overlap)")
    p.add_argument("--overlap-ranks", type=int, nargs="+", default=[4])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "dispatch_cpu.json"))
    args = p.parse_args()

    out_path = Path(args.out)
    out = json.loads(out_path.read_text()) if out_path.exists() else {}
    out["machine"] = machine()
    if "movement" in args.parts:
        out.update(run_movement(args))
    if "overlap" in args.parts:
        out["overlap"] = run_overlap(args)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
