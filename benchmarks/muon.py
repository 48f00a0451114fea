"""Is Muon worth it? optim.update=muon against adamw on the default model and the built-in corpus.

1. A learning-rate sweep per rule (`--sweep-lrs`, seed 0, `--sweep-steps` steps): the best final val_loss picks
   each rule's learning rate (optim.muon_adjust_lr=match_rms_adamw, so one lr means the same update RMS for both).
2. Each rule at its best lr over the default budget (the recipe's steps), `--seeds` seeds, in round-robin order:
   val_loss at equal steps (each evaluation) and at equal wall time (per seed, the last evaluation each rule
   reached within the shorter of the two runs' training seconds), and the optimizer step's time
   (`profile.timers`: time_optimizer_s, median over the steps after the first).
3. Newton-Schulz time per rank at 1, 2 and 4 ranks (ep_aware, ep = 1): the units each rank owns under Muon's
   whole-matrix ownership (optimus.optim.muon_exchange), timed here on this process, one rank after the other;
   max over the ranks and the sum. `--newton-schulz-only` re-times this part alone into existing results.

    python benchmarks/muon.py [--seeds 0 1 2] [--sweep-lrs 1.5e-3 3e-3 6e-3] [--sweep-steps 100]
                              [--newton-schulz-only] [--out benchmarks/results] [OVERRIDE ...]

Writes results/muon.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what `optimus train` runs with (optimus/cli.py)

import torch  # noqa: E402

from optimus.model import Transformer  # noqa: E402
from optimus.optim.muon import NS_COEFFICIENTS, muon_slots_of, newton_schulz, unit_blocks  # noqa: E402
from optimus.optim.muon_exchange import MuonExchange  # noqa: E402
from optimus.parallel.flat_buffer import FlatParams, param_groups  # noqa: E402
from optimus.recipes import load_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import machine_meta  # noqa: E402

RULES = ("adamw", "muon")


def train(overrides: list[str], run_dir: Path) -> dict:
    """One `optimus train` run with profile.timers: its evaluations with the training seconds before each."""
    cmd = [sys.executable, "-m", "optimus", "train", *overrides, "logging.progress=false", "profile.timers=true",
           f"run.dir={run_dir}"]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals, seconds = [], 0.0
    for r in records:
        seconds += r.get("step_time_s", 0.0)
        if "val_loss" in r:
            evals.append({"step": r["step"], "train_seconds": seconds, "val_loss": r["val_loss"]})
    steps = [r for r in records if "loss" in r]
    return {
        "evals": evals,
        "final_val_loss": evals[-1]["val_loss"],
        "train_seconds": seconds,
        "optimizer_s_median": statistics.median(r["time_optimizer_s"] for r in steps[1:]),
        "step_s_median": statistics.median(r["step_time_s"] for r in steps[1:]),
        "wall_s": wall,
    }


def at_time(evals: list[dict], seconds: float) -> dict:
    """The last evaluation reached within `seconds` of training."""
    return [e for e in evals if e["train_seconds"] <= seconds + 1e-9][-1]


def newton_schulz_per_rank(overrides: list[str], worlds=(1, 2, 4), repeats: int = 3) -> dict:
    """Seconds of Newton-Schulz each rank of an ep_aware layout (ep = 1) spends per step, by world size."""
    cfg = load_config(overrides)
    out = {}
    for world in worlds:
        per_rank = []
        for rank in range(world):
            model = Transformer(cfg.model, kernels="torch")
            model.init_weights(torch.Generator().manual_seed(0))
            batches: dict[tuple[int, int], list[torch.Tensor]] = {}
            for named in param_groups(model).values():
                if not named:
                    continue
                flat = FlatParams(named, world, rank, 2**62)
                slots = muon_slots_of(flat)
                for u in MuonExchange(flat, slots).owned if slots else []:
                    unit = flat.buffer[u.lo : u.hi].detach().float()
                    for b in unit_blocks(u.slot, unit):
                        batches.setdefault(tuple(b.shape), []).append(b)
            stacked = [torch.stack(ms) for ms in batches.values()]
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                for x in stacked:
                    newton_schulz(x, 5, NS_COEFFICIENTS)
                times.append(time.perf_counter() - start)
            per_rank.append(statistics.median(times[1:]))
        out[str(world)] = {"per_rank_s": per_rank, "max_s": max(per_rank), "sum_s": sum(per_rank)}
    return out


def report(results: dict) -> str:
    meta, best, finals = results["meta"], results["best_lr"], results["finals"]
    lines = [
        f"# Muon against AdamW on the default model ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['machine']}, {meta['cores']} cores ({meta['cpu_flags']}), torch {meta['torch']}; load "
        f"average {meta['load_start']:.1f} at the start, {meta['load_end']:.1f} at the end.",
        "",
        f"Learning-rate sweep ({meta['sweep_steps']} steps, seed 0, final val_loss; optim.muon_adjust_lr="
        "match_rms_adamw):",
        "",
        "| lr | " + " | ".join(RULES) + " |",
        "|---:|" + "---:|" * len(RULES),
    ]
    for lr in meta["sweep_lrs"]:
        cells = [f"{results['sweep'][rule][str(lr)]:.4f}" for rule in RULES]
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Best: adamw lr {best['adamw']:g}, muon lr {best['muon']:g}. Default budget ({meta['steps']} steps), "
        f"seeds {', '.join(map(str, meta['seeds']))}, each at its best lr:",
        "",
        "| rule | val_loss at the end, mean (min-max) | val_loss at equal wall time, mean | optimizer step, "
        "median s | step, median s |",
        "|---|---|---:|---:|---:|",
    ]
    for rule in RULES:
        runs = finals[rule]
        final = [r["final_val_loss"] for r in runs]
        equal_time = [r["val_loss_at_equal_time"] for r in runs]
        lines.append(
            f"| {rule} | {statistics.mean(final):.4f} ({min(final):.4f}-{max(final):.4f}) "
            f"| {statistics.mean(equal_time):.4f} | {statistics.median(r['optimizer_s_median'] for r in runs):.4f} "
            f"| {statistics.median(r['step_s_median'] for r in runs):.4f} |"
        )
    steps = [e["step"] for e in finals["adamw"][0]["evals"]]
    lines += ["", "val_loss at each evaluation, mean over the seeds:", ""]
    lines += ["| step | adamw | muon |", "|---:|---:|---:|"]
    for i, step in enumerate(steps):
        cells = [statistics.mean(r["evals"][i]["val_loss"] for r in finals[rule]) for rule in RULES]
        lines.append(f"| {step} | {cells[0]:.4f} | {cells[1]:.4f} |")
    lines += [
        "",
        "Newton-Schulz seconds per step of each rank (ep_aware, ep = 1; the units the rank owns, "
        f"timed on this process{results.get('newton_schulz_note', '')}):",
        "",
        "| ranks | per rank | max | sum |",
        "|---:|---|---:|---:|",
    ]
    for world, ns in results["newton_schulz"].items():
        per = ", ".join(f"{t * 1e3:.1f}" for t in ns["per_rank_s"])
        lines.append(f"| {world} | {per} ms | {ns['max_s'] * 1e3:.1f} ms | {ns['sum_s'] * 1e3:.1f} ms |")
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    text = report(results)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "muon.md").write_text(text)
    (out / "muon.json").write_text(json.dumps(results, indent=2) + "\n")


def retime_newton_schulz(out: Path, overrides: list[str]) -> None:
    """Part 3 again, into the results of an earlier full run (its training figures are kept as they were)."""
    results = json.loads((out / "muon.json").read_text())
    meta = machine_meta("muon.py")
    results["newton_schulz"] = newton_schulz_per_rank(overrides)
    results["newton_schulz_note"] = f"; re-timed {meta['date']} by `{meta['command']}`"
    write(results, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sweep-lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3])
    parser.add_argument("--sweep-steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--newton-schulz-only", action="store_true", help="re-time part 3 into existing results")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    if args.newton_schulz_only:
        retime_newton_schulz(args.out, args.overrides)
        return
    cfg = load_config(args.overrides)
    meta = {
        **machine_meta("muon.py"),
        "seeds": args.seeds,
        "sweep_lrs": args.sweep_lrs,
        "sweep_steps": args.sweep_steps,
        "steps": cfg.train.steps,
    }
    sweep: dict[str, dict[str, float]] = {rule: {} for rule in RULES}
    finals: dict[str, list[dict]] = {rule: [] for rule in RULES}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for lr in args.sweep_lrs:
            for rule in RULES:
                extra = [f"optim.update={rule}", f"optim.lr={lr}", f"train.steps={args.sweep_steps}",
                         f"train.eval_interval={args.sweep_steps}"]  # fmt: skip
                result = train([*args.overrides, *extra], work / f"sweep-{rule}-{lr:g}")
                sweep[rule][str(lr)] = result["final_val_loss"]
                print(f"sweep {rule} lr {lr:g}: val_loss {result['final_val_loss']:.4f}", flush=True)
        best = {rule: float(min(sweep[rule], key=sweep[rule].get)) for rule in RULES}
        for seed in args.seeds:
            for rule in RULES:
                extra = [f"optim.update={rule}", f"optim.lr={best[rule]}", f"train.seed={seed}"]
                result = train([*args.overrides, *extra], work / f"{rule}-seed{seed}")
                result["seed"] = seed
                finals[rule].append(result)
                print(f"{rule} seed {seed}: val_loss {result['final_val_loss']:.4f}", flush=True)
    for a, b in zip(finals["adamw"], finals["muon"]):  # equal wall time: the shorter of the pair's training times
        seconds = min(a["train_seconds"], b["train_seconds"])
        for r in (a, b):
            r["val_loss_at_equal_time"] = at_time(r["evals"], seconds)["val_loss"]
            r["equal_time_s"] = seconds
    results = {
        "meta": meta, "sweep": sweep, "best_lr": best, "finals": finals,
        "newton_schulz": newton_schulz_per_rank(args.overrides),
    }  # fmt: skip
    meta["load_end"] = os.getloadavg()[0]
    write(results, args.out)


if __name__ == "__main__":
    main()
