"""`optimus plan --search` on the MoE experiment recipes at their published node counts.

python benchmarks/search.py run --only RECIPE ... [--jobs J] [--out benchmarks/results]
    each recipe's search (`optimus plan --search --json`), timed on this machine with nothing else running:
    search_results.json (rows of the recipes given replaced, the others kept)
python benchmarks/search.py seed [--only RECIPE ...] [--out benchmarks/results]
    the Aurora MoE study's claim priced: each recipe's layout predicted with optim.sharding=standard and ep_aware,
    and with the torch expert path (kernels=torch) and the Triton kernels (kernels=triton), on its device path:
    search_seed.json
python benchmarks/search.py overlap [--only RECIPE ...] [--out benchmarks/results]
    each recipe's layout predicted with optim.overlap_param_gather=false and =true (the parameter all-gathers
    waited for at the end of the step, or left to the next forward: optimus.perf.carried): search_overlap.json
python benchmarks/search.py tables [--out benchmarks/results]
    the markdown tables of benchmarks/results/search.md from search_results.json (its text is written by
    hand around them)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from memory import cpu_flags  # noqa: E402  benchmarks/ is first on sys.path

# The MoE recipes at the node counts of benchmarks/results/dry_run.md (3,072 ranks; the DeepSeek-V3-scale
# recipe at its 192 nodes).
RECIPES = {
    "aurora-mula-7b-a1b": 256, "aurora-mula-20b-a2b": 256, "aurora-mula-100b-a7b": 256,
    "aurora-mula-220b-a10b": 256, "frontier-mula-20b-a2b": 384, "frontier-mula-100b-a7b": 384,
    "frontier-mula-220b-a10b": 384, "aurora-deepseek-v3-1t": 192,
}  # fmt: skip
RESULTS = "search_results.json"
SEED = "search_seed.json"
OVERLAP = "search_overlap.json"
SEED_COMBINATIONS = [(s, k) for k in ("torch", "triton") for s in ("standard", "ep_aware")]


def run(names: list[str], jobs: int | None, out: Path) -> None:
    path = out / RESULTS
    rows = json.loads(path.read_text()) if path.exists() else {}
    for name in names:
        command = ["optimus", "plan", "--search", "--json", "--nodes", str(RECIPES[name]), f"experiment={name}"]
        command += ["--jobs", str(jobs)] if jobs else []
        print(" ".join(command), flush=True)
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        seconds = time.perf_counter() - started
        if done.returncode not in (0, 1):
            raise SystemExit(f"{name}: the search failed:\n{done.stderr[-2000:]}")
        result = json.loads(done.stdout)
        rows[name] = {
            "command": " ".join(command[1:]), "wall_s": seconds, "result": result,
            "machine": {"cpus": len(os.sched_getaffinity(0)), "cpu_flags": cpu_flags(), "torch": _torch()},
        }  # fmt: skip
        path.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"  {seconds:.0f} s; {len(result['ranked'])} layouts predicted", flush=True)


def _predicted(name: str, overrides: list[str]) -> dict:
    """`optimus plan --predict --json` of a recipe at its node count with `overrides`: the figures the tables use."""
    command = ["optimus", "plan", "--predict", "--json", "--nodes", str(RECIPES[name]), f"experiment={name}"]
    command += overrides
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode not in (0, 1):  # 1: predicted, but its planned peak does not fit
        raise SystemExit(f"{name}: the prediction failed:\n{done.stderr[-2000:]}")
    p = json.loads(done.stdout)
    keep = ("step_time_s", "step_time_s_range", "mfu", "mfu_range", "time_split", "fits", "peak_bytes")
    return {k: p[k] for k in keep}


def _predicted_rows(file: str, names: list[str], variants: dict[str, list[str]], out: Path) -> None:
    """Each recipe predicted with each variant's overrides, into `out / file` (rows of `names` replaced)."""
    path = out / file
    rows = json.loads(path.read_text()) if path.exists() else {}
    for name in names:
        rows[name] = {"machine": {"cpus": len(os.sched_getaffinity(0)), "cpu_flags": cpu_flags(), "torch": _torch()}}
        for label, overrides in variants.items():
            rows[name][label] = _predicted(name, overrides)
            print(f"{name} {label}: {rows[name][label]['step_time_s']:.3f} s", flush=True)
        path.write_text(json.dumps(rows, indent=1) + "\n")


def seed(names: list[str], out: Path) -> None:
    variants = {f"{s}+{k}": [f"optim.sharding={s}", f"kernels={k}"] for s, k in SEED_COMBINATIONS}
    _predicted_rows(SEED, names, variants, out)


def overlap(names: list[str], out: Path) -> None:
    variants = {f"overlap_param_gather={flag}": [f"optim.overlap_param_gather={flag}"] for flag in ("false", "true")}
    _predicted_rows(OVERLAP, names, variants, out)


def overlap_table(out: Path) -> None:
    rows = json.loads((out / OVERLAP).read_text())
    print("| recipe | step s, gathers at the step's end | step s, left to the next forward | speed-up | "
          "exposed data-parallel s (end -> next forward) | MFU % (likely) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        off, on = row["overlap_param_gather=false"], row["overlap_param_gather=true"]
        dp = [r["time_split"].get("exposed_data_parallel", 0.0) for r in (off, on)]
        print(f"| {name} | {off['step_time_s']:.3f} | {on['step_time_s']:.3f} | "
              f"{off['step_time_s'] / on['step_time_s']:.3f}x | {dp[0]:.3f} -> {dp[1]:.3f} | "
              f"{100 * off['mfu']:.1f} -> {100 * on['mfu']:.1f} |")  # fmt: skip


def seed_table(out: Path) -> None:
    rows = json.loads((out / SEED).read_text())
    names = [f"{s}+{k}" for s, k in SEED_COMBINATIONS]
    print("| recipe | " + " | ".join(f"{n} step s" for n in names) + " | both / neither | kernels alone | "
          "ep_aware alone |")  # fmt: skip
    print("|---|" + "---|" * (len(names) + 3))
    for name, row in rows.items():
        steps = {n: row[n]["step_time_s"] for n in names}
        base = steps["standard+torch"]
        gains = (base / steps["ep_aware+triton"], base / steps["standard+triton"], base / steps["ep_aware+torch"])
        print(f"| {name} | " + " | ".join(f"{steps[n]:.2f}" for n in names) + " | "
              + " | ".join(f"{g:.2f}x" for g in gains) + " |")  # fmt: skip


def _torch() -> str:
    import torch

    return torch.__version__


def _pct(value: float, bounds: list[float] | None) -> str:
    low, high = bounds or (value, value)
    return f"{100 * low:.1f} - **{100 * value:.1f}** - {100 * high:.1f}"


def tables(out: Path) -> None:
    rows = json.loads((out / RESULTS).read_text())
    print("| recipe | ranks | search s | predicted | layout | step s | MFU % (low - likely - high) | split |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        result = row["result"]
        values = result["recipe"]  # the layout the search started from (the recipe as it was then)
        recipe = next((v for v in result["ranked"] if _is_recipe(v, values)), None)
        best = result["ranked"][0] if result["ranked"] else None
        for label, visit in (("recipe's", recipe), ("search's", best)):
            if visit is None:
                print(f"| {name} | {result['world']} | | | {label}: not predicted (does not fit) | | | |")
                continue
            p = visit["prediction"]
            total = sum(p["time_split"].values())
            largest = sorted(p["time_split"].items(), key=lambda kv: -kv[1])[:3]
            split = ", ".join(f"{k} {100 * s / total:.0f}%" for k, s in largest)
            print(f"| {name} | {result['world']} | {row['wall_s']:.0f} | {len(result['ranked'])} | {label} | "
                  f"{p['step_time_s']:.2f} | {_pct(p['mfu'], p.get('mfu_range'))} | {split} |")  # fmt: skip


def changes_table(out: Path) -> None:
    from optimus.perf.search import overrides

    rows = json.loads((out / RESULTS).read_text())
    print("| recipe | the search's layout: the keys it changes |")
    print("|---|---|")
    for name, row in rows.items():
        best = row["result"]["winner"]
        recipe = row["result"]["recipe"]
        changed = {k: v for k, v in best["values"].items() if v != recipe[k]} if best else {}
        print(f"| {name} | {' '.join(f'`{o}`' for o in overrides(changed)) or 'none'} |")


def _is_recipe(visit: dict, recipe: dict) -> bool:
    """Whether a ranked layout changes none of the recipe's keys (its checkpointing may be the search's)."""
    from optimus.perf.search import CHECKPOINTING

    return all(visit["values"][k] == v for k, v in recipe.items() if k != CHECKPOINTING)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("run", "seed", "overlap", "tables"))
    parser.add_argument("--only", nargs="+", choices=sorted(RECIPES), default=[])
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    if args.mode == "run":
        run(args.only or list(RECIPES), args.jobs, args.out)
    elif args.mode == "seed":
        seed(args.only or list(RECIPES), args.out)
    elif args.mode == "overlap":
        overlap(args.only or list(RECIPES), args.out)
    else:
        tables(args.out)
        print()
        changes_table(args.out)
        if (args.out / SEED).exists():
            print()
            seed_table(args.out)
        if (args.out / OVERLAP).exists():
            print()
            overlap_table(args.out)


if __name__ == "__main__":
    main()
