"""Optimizer-state memory and step time of the three sharding schemes (none, standard, ep_aware).

Two tables:
1. Measured on this machine at world 4 (EP 2 x DP 2 and EP 4), local gloo processes:
   per-rank optimizer-state bytes (and the formula's value), optimizer step time
   (reduce + clip + AdamW + all-gather, or its launch with optim.overlap_param_gather)
   and whole train-step time.
2. Computed from the same formulas for the Mula recipes at their Aurora layouts:
   per-device optimizer-state GB for bf16 parameters (fp32 master + two fp32
   moments = 12 bytes per owned parameter), parameters divided evenly over the
   pipeline stages.

Every scheme's model and optimizer are built first; the steps then run round-robin (a turn of STEPS_PER_TURN
steps of each scheme in turn, the order rotated every turn), so that load on a shared CPU hits every scheme
alike.

    python benchmarks/optimizer.py [--turns 16] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from optimus.config import ModelConfig, MoEConfig, OptimusConfig, ParallelConfig
from optimus.model import Transformer, count_params, count_params_of_config
from optimus.optim import build_optimizer
from optimus.parallel import build_parallel_state, parallelize_model

BENCH_MODEL = ModelConfig(
    n_layers=4, dim=256, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_dim=1024,
    moe=MoEConfig(n_experts=8, top_k=2, expert_dim=512),
)  # fmt: skip
WORLD, MICRO_BATCH, SEQ = 4, 2, 128
STEPS_PER_TURN = 2  # consecutive steps of one scheme in its round-robin turn
# (optim.sharding, optim.zero, optim.overlap_param_gather)
SCHEMES = [
    ("none", 1, False), ("standard", 1, False), ("ep_aware", 1, False), ("ep_aware", 1, True),
    ("standard", 2, False), ("ep_aware", 2, False), ("ep_aware", 2, True),
]  # fmt: skip
AURORA = [("mula-20b-a2b", 256, 12, 1), ("mula-100b-a7b", 64, 12, 4), ("mula-220b-a10b", 32, 12, 8)]  # dp, ep, pp


def state_bytes_formula(scheme: str, dense: float, expert: float, dp: int, ep: int, per_param: int) -> float:
    """Optimizer-state bytes one device holds, for `dense` / `expert` parameters of its pipeline stage."""
    if scheme == "none":
        return per_param * (dense + expert / ep)
    if scheme == "standard":
        return per_param * (dense / dp + expert / (ep * dp))
    return per_param * (dense + expert) / (dp * ep)


def _rank(rank: int, ep: int, turns: int, init_file: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        ps = build_parallel_state(ep)
        tokens = torch.randint(
            0, BENCH_MODEL.vocab_size, (turns, MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank)
        )
        runs = []  # (scheme, zero, overlap, model, optimizer, its counts), one per row of SCHEMES, all alive at once
        for scheme, zero, overlap in SCHEMES:
            cfg = OptimusConfig(model=BENCH_MODEL)
            cfg.optim.sharding, cfg.optim.zero = scheme, zero
            cfg.optim.update = "adamw"  # the committed results' rule (benchmarks/memory.py, ADAMW)
            model = Transformer(BENCH_MODEL, kernels="torch")
            model.init_weights(torch.Generator().manual_seed(0))
            parallelize_model(model, ps, ParallelConfig(ep=ep))
            opt = build_optimizer(model, cfg, ps)
            if overlap:  # what the trainer does with optim.overlap_param_gather=true
                opt.overlap_param_gather([model])
            runs.append((scheme, zero, overlap, model, opt, count_params(model, BENCH_MODEL)))
        opt_times = [[] for _ in runs]
        step_times = [[] for _ in runs]
        for turn in range(turns):
            # Round-robin, order rotated every turn, so that a slow moment of this shared CPU hits every scheme.
            # A turn is STEPS_PER_TURN steps of one scheme and the wait for its last all-gathers: a step's
            # gathers overlap the next step's forward, never another scheme's.
            for i in [(turn + k) % len(runs) for k in range(len(runs))]:
                _, _, _, model, opt, _ = runs[i]
                dist.barrier()
                start = time.perf_counter()
                for _ in range(STEPS_PER_TURN):  # one backward per step: the optimizer counts it as the last
                    # The router losses (BENCH_MODEL's coefficients) ride on the LM loss's backward.
                    logits_BSV = model(tokens[turn, :, :-1])
                    loss = F.cross_entropy(logits_BSV.flatten(0, 1), tokens[turn, :, 1:].reshape(-1))
                    loss.backward()
                    opt_start = time.perf_counter()
                    opt.step(1e-4)
                    opt.zero_grad()
                    opt_times[i].append(time.perf_counter() - opt_start)
                opt.wait_for_params()
                step_times[i].append((time.perf_counter() - start) / STEPS_PER_TURN)
        rows = []
        for (scheme, zero, overlap, _, opt, counts), opt_s, step_s in zip(runs, opt_times, step_times):
            mem = opt.memory_bytes()
            per_param = 8  # fp32 parameters here: two fp32 moments, no master copy
            rows.append({
                "scheme": scheme, "zero": zero, "overlap_param_gather": overlap,
                "ep": ep, "dp": WORLD // ep, "rank": rank,
                "optim_state_bytes": mem["optim_state_bytes"], "padding_bytes": mem["padding_bytes"],
                "formula_bytes": state_bytes_formula(scheme, counts.dense, counts.expert, WORLD // ep, ep, per_param),
                "optimizer_step_ms": 1e3 * statistics.median(opt_s[STEPS_PER_TURN:]),  # first turn: warm-up
                "train_step_ms": 1e3 * statistics.median(step_s[1:]),
                "params_dense": counts.dense, "params_expert": counts.expert,
            })  # fmt: skip
        results.put(rows)
    finally:
        dist.destroy_process_group()


def measure(turns: int) -> list[dict]:
    rows = []
    ctx = mp.get_context("spawn")
    for ep in (2, 4):
        results = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "init")
            procs = [ctx.Process(target=_rank, args=(r, ep, turns, init_file, results)) for r in range(WORLD)]
            for p in procs:
                p.start()
            per_rank = [results.get(timeout=1800) for _ in procs]
            for p in procs:
                p.join()
        for i in range(len(SCHEMES)):  # one row per scheme: max over ranks (the slowest / fullest rank bounds a job)
            ranks = [r[i] for r in per_rank]
            row = dict(ranks[0])
            del row["rank"]
            for key in ("optim_state_bytes", "padding_bytes", "formula_bytes", "optimizer_step_ms", "train_step_ms"):
                row[key] = max(r[key] for r in ranks)
            rows.append(row)
    return rows


def recipe_table() -> list[dict]:
    from optimus.cli import load_config

    rows = []
    for name, dp, ep, pp in AURORA:
        counts = count_params_of_config(load_config([f"model={name}"]).model)
        dense, expert = counts.dense / pp, counts.expert / pp
        row = {"recipe": name, "dp": dp, "ep": ep, "pp": pp, "devices": dp * ep * pp,
               "params_dense": counts.dense, "params_expert": counts.expert}  # fmt: skip
        for scheme in ("none", "standard", "ep_aware"):
            row[f"{scheme}_gb"] = state_bytes_formula(scheme, dense, expert, dp, ep, 12) / 1e9
        rows.append(row)
    return rows


def markdown(measured: list[dict], recipes: list[dict], turns: int) -> str:
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f.startswith("avx512")})
    lines = [
        f"Command: `python benchmarks/optimizer.py`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} cores ({' '.join(flags) or 'no AVX-512'}), load {os.getloadavg()[0]:.2f} at the end.",
        "",
        f"## Measured: world {WORLD} (gloo, CPU), fp32 parameters, {BENCH_MODEL.n_layers}L d{BENCH_MODEL.dim} "
        f"E{BENCH_MODEL.moe.n_experts}, micro-batch {MICRO_BATCH}x{SEQ}; max over ranks, median over steps",
        "",
        f"The schemes ran round-robin ({turns} turns of {STEPS_PER_TURN} steps each, the first turn not counted; a",
        "turn ends by waiting for its last parameter all-gathers), so that load on a shared CPU hits every scheme",
        "alike: compare rows of one layout, not across runs. Train step: a turn's time over its steps.",
        "",
        "The train step is the comparison between schemes: the optimizer step counts only what is left of the",
        "gradient reduction when the backward ends, and `standard` runs its EP all-reduce of dense gradients",
        "inside the backward (synchronously, before its DP reduce-scatter), so part of its cost is not in that column.",
        "Parameter all-gather: `step` = before step() returns; `forward` = `optim.overlap_param_gather=true`, each",
        "block waits for its own buckets in the next forward (the wait then counts in the train step only).",
        "",
        "| EP x DP | scheme | ZeRO | param all-gather | optim state / rank (MB) | formula (MB) | optimizer step (ms) "
        "| train step (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in measured:
        lines.append(
            f"| {r['ep']} x {r['dp']} | {r['scheme']} | {r['zero'] if r['scheme'] != 'none' else '-'} | "
            f"{'forward' if r['overlap_param_gather'] else 'step'} | "
            f"{r['optim_state_bytes'] / 1e6:.3f} | {r['formula_bytes'] / 1e6:.3f} | "
            f"{r['optimizer_step_ms']:.1f} | {r['train_step_ms']:.1f} |"
        )
    lines += [
        "",
        "## Computed: optimizer state per device (GB = 1e9 bytes), bf16 params: 12 bytes per owned parameter",
        "",
        "| recipe | DP x EP x PP | dense params | expert params | none | standard | ep_aware | standard / ep_aware |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in recipes:
        lines.append(
            f"| {r['recipe']} | {r['dp']} x {r['ep']} x {r['pp']} | {r['params_dense'] / 1e9:.2f} B | "
            f"{r['params_expert'] / 1e9:.2f} B | {r['none_gb']:.2f} | {r['standard_gb']:.3f} | "
            f"{r['ep_aware_gb']:.3f} | "
            f"{r['standard_gb'] / r['ep_aware_gb']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=16, help="round-robin turns per scheme")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    recipes = recipe_table()
    measured = measure(args.turns)
    text = markdown(measured, recipes, args.turns)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "world": WORLD,
        "model": BENCH_MODEL.__dict__ | {"moe": BENCH_MODEL.moe.__dict__},
        "measured": measured,
        "recipes": recipes,
    }
    (args.out / "optimizer_cpu.json").write_text(json.dumps(payload, indent=2))
    (args.out / "optimizer_cpu.md").write_text(text)


if __name__ == "__main__":
    main()
