"""Does the MoE earn its keep? The default MoE against dense models of the same active and the same total size.

On the built-in corpus and the default recipe's budget (its steps, batch and sequence length), three models:

- `moe`: the default recipe as it is (`optimus train` with no overrides but the seed);
- `dense-active`: dense, with the MoE's active parameters per token: `model.moe.n_experts=0` and
  `model.ffn_dim = (top_k + n_shared_experts) x expert_dim`, so a token meets as many FFN weights as in the MoE;
- `dense-total`: dense, with the MoE's total parameters: `model.ffn_dim = (n_experts + n_shared_experts) x
  expert_dim`, every expert's weights used by every token (top_k / n_experts of its FFN FLOPs would be the MoE's).

Each trains through `optimus train` once per seed (`train.seed`: the initial weights and the data order), the
runs in round-robin order (seed 0 of each model, then seed 1, ...); the table gives the held-out loss at every
evaluation (`val_loss` in metrics.jsonl) as mean and spread over the seeds, and the parameter counts from each
run's run_info.json. Throughput is measured apart, side by side: the three models are built in this process
(seed 0) and take turns of a few training steps each (`--turns` of `--steps-per-turn`, the order rotating every
turn, the first turn not counted); each turn's tokens/s is divided by the MoE's of the same turn and the table
gives the median ratio, so that load from other processes on a shared machine hits all three alike. The
training runs' own tokens/s (median over their steps) are listed too, but they ran at different times.

    python benchmarks/moe_vs_dense.py [--seeds 0 1 2] [--turns 9] [--steps-per-turn 3] [--out benchmarks/results]
                                      [--skip-training] [--skip-throughput] [OVERRIDE ...]

OVERRIDEs (`key=value`) go to all three models, e.g. `train.steps=50` for a quick look.
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


from optimus.recipes import load_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import machine_meta  # noqa: E402

MODELS = ("moe", "dense-active", "dense-total")


def model_overrides(overrides: list[str]) -> dict[str, list[str]]:
    """Each model's overrides on top of the default recipe (and the user's `overrides`)."""
    moe = load_config(overrides).model.moe
    width = moe.expert_dim
    return {
        "moe": [],
        "dense-active": ["model.moe.n_experts=0", f"model.ffn_dim={(moe.top_k + moe.n_shared_experts) * width}"],
        "dense-total": ["model.moe.n_experts=0", f"model.ffn_dim={(moe.n_experts + moe.n_shared_experts) * width}"],
    }


def train(overrides: list[str], run_dir: Path) -> dict:
    """One `optimus train` run: its evaluations, parameter counts and tokens/s."""
    cmd = [sys.executable, "-m", "optimus", "train", *overrides, "logging.progress=false", f"run.dir={run_dir}"]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    info = json.loads((run_dir / "run_info.json").read_text())
    steps = [r for r in records if "loss" in r]
    return {
        "val_loss": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
        "params": info["params"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[1:]),
        "expert_load_imbalance": [r.get("expert_load_imbalance") for r in steps],
        "wall_s": wall,
    }


def throughput(models: dict[str, list[str]], turns: int, steps_per_turn: int, work: Path) -> dict:
    """tokens/s of each model, measured in turns of `steps_per_turn` training steps, the models alternating."""
    from optimus.train.trainer import Trainer

    trainers = {}
    for name, extra in models.items():
        cfg = load_config([*extra, "logging.progress=false", f"run.dir={work / ('tput-' + name)}"])
        trainers[name] = Trainer.from_config(cfg)
    tokens = {name: t.cfg.train.global_batch * t.cfg.train.seq_len for name, t in trainers.items()}
    per_turn: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    try:
        for turn in range(turns + 1):
            order = names[turn % len(names) :] + names[: turn % len(names)]
            for name in order:
                trainer = trainers[name]
                start = time.perf_counter()
                for _ in range(steps_per_turn):
                    trainer.train_step()
                    trainer.step += 1
                seconds = time.perf_counter() - start
                if turn:  # the first turn builds every kernel and warms the allocator
                    per_turn[name].append(steps_per_turn * tokens[name] / seconds)
    finally:
        for trainer in trainers.values():
            trainer.loader.close()
    ratios = {name: [a / b for a, b in zip(per_turn[name], per_turn["moe"])] for name in models}
    return {
        name: {
            "tokens_per_s_median": statistics.median(per_turn[name]),
            "tokens_per_s_turns": per_turn[name],
            "ratio_to_moe_median": statistics.median(ratios[name]),
            "ratio_to_moe_min": min(ratios[name]),
            "ratio_to_moe_max": max(ratios[name]),
        }
        for name in models
    }


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.mean(values), min(values), max(values)


def report(results: dict) -> str:
    runs, tput, meta = results["runs"], results.get("throughput"), results["meta"]
    seeds = meta["seeds"]
    lines = [
        f"# MoE against dense models at the default budget ({meta['date']}, load {meta['load_end']:.1f} at the end)",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['machine']}, {meta['cores']} cores ({meta['cpu_flags']}), torch {meta['torch']}, "
        f"train.dtype={meta['dtype']}. The machine was shared with other jobs (load average {meta['load_start']:.1f} "
        f"at the start, {meta['load_end']:.1f} at the end, on {meta['cores']} cores): throughput is comparable only "
        "within the side-by-side measurement; the losses do not depend on it.",
        "",
        f"Budget: {meta['steps']} steps of {meta['global_batch']} x {meta['seq_len']} tokens "
        f"({meta['steps'] * meta['global_batch'] * meta['seq_len']:,} tokens), seeds {', '.join(map(str, seeds))}.",
        "",
        "| model | overrides | params total | active per token | val_loss at the end, mean (min-max) | "
        "tokens/s side by side (vs moe) | tokens/s of the runs |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for name in MODELS:
        r = runs[name]
        params = r["seeds"][0]["params"]
        final = [s["val_loss"][str(meta["steps"])] for s in r["seeds"]]
        mean, lo, hi = spread(final)
        t = tput[name] if tput else None
        side = f"{t['tokens_per_s_median']:,.0f} ({t['ratio_to_moe_median']:.2f}x)" if t else "-"
        run_tps = statistics.median(s["tokens_per_s"] for s in r["seeds"])
        lines.append(
            f"| {name} | `{' '.join(r['overrides']) or '(default)'}` | {params['total'] / 1e6:.2f}M "
            f"| {params['active'] / 1e6:.2f}M | {mean:.4f} ({lo:.4f}-{hi:.4f}) | {side} | {run_tps:,.0f} |"
        )
    steps = sorted({int(k) for k in runs["moe"]["seeds"][0]["val_loss"]})
    lines += [
        "",
        "Held-out loss at each evaluation, mean over the seeds (min-max):",
        "",
        "| step | " + " | ".join(MODELS) + " |",
        "|---:|" + "---|" * len(MODELS),
    ]
    for step in steps:
        cells = []
        for name in MODELS:
            mean, lo, hi = spread([s["val_loss"][str(step)] for s in runs[name]["seeds"]])
            cells.append(f"{mean:.4f} ({lo:.4f}-{hi:.4f})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    if tput:
        lines += [
            "",
            f"Side by side: {meta['turns']} turns of {meta['steps_per_turn']} steps per model, the order rotating "
            "each turn (a first turn not counted); ratio = a turn's tokens/s over the MoE's in the same turn, "
            "median (min-max) over the turns:",
            "",
            "| model | tokens/s, median | ratio to moe, median (min-max) |",
            "|---|---:|---|",
        ]
        for name in MODELS:
            t = tput[name]
            lines.append(
                f"| {name} | {t['tokens_per_s_median']:,.0f} | {t['ratio_to_moe_median']:.3f} "
                f"({t['ratio_to_moe_min']:.3f}-{t['ratio_to_moe_max']:.3f}) |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--turns", type=int, default=9)
    parser.add_argument("--steps-per-turn", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--skip-training", action="store_true", help="throughput only (keeps the last runs' numbers)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("overrides", nargs="*", help="key=value for all three models")
    args = parser.parse_args()
    models = {name: [*args.overrides, *extra] for name, extra in model_overrides(args.overrides).items()}
    cfg = load_config(args.overrides)
    json_path = args.out / "moe_vs_dense.json"
    previous = json.loads(json_path.read_text()) if args.skip_training and json_path.exists() else None
    meta = {
        **machine_meta("moe_vs_dense.py"),
        "seeds": args.seeds,
        "steps": cfg.train.steps,
        "global_batch": cfg.train.global_batch,
        "seq_len": cfg.train.seq_len,
        "turns": args.turns,
        "steps_per_turn": args.steps_per_turn,
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if previous is not None:
            runs = previous["runs"]
            meta["seeds"] = previous["meta"]["seeds"]
        else:
            runs = {name: {"overrides": model_overrides(args.overrides)[name], "seeds": []} for name in MODELS}
            for seed in args.seeds:  # round-robin: load drift during the runs spreads over the models alike
                for name in MODELS:
                    run_dir = work / f"{name}-seed{seed}"
                    result = train([*models[name], f"train.seed={seed}"], run_dir)
                    result["val_loss"] = {str(k): v for k, v in result["val_loss"].items()}
                    result["seed"] = seed
                    runs[name]["seeds"].append(result)
                    if meta.get("dtype") is None:
                        meta["dtype"] = load_config_yaml(run_dir)["train"]["dtype"]
                    final = result["val_loss"][str(cfg.train.steps)]
                    print(f"{name} seed {seed}: val_loss {final:.4f}, {result['wall_s']:.0f} s", flush=True)
        meta.setdefault("dtype", previous["meta"].get("dtype") if previous else None)
        tput = None if args.skip_throughput else throughput(models, args.turns, args.steps_per_turn, work)
    meta["load_end"] = os.getloadavg()[0]
    results = {"meta": meta, "runs": runs, "throughput": tput}
    text = report(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_vs_dense.md").write_text(text)
    json_path.write_text(json.dumps(results, indent=2) + "\n")


def load_config_yaml(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


if __name__ == "__main__":
    main()
