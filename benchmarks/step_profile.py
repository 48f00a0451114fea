"""Where one training step of the default `optimus train` spends its time, and its MFU; with AdamW at 3e-3 (`ADAMW`,
as the committed results were measured): add `optim.update=muon optim.lr=6e-3` for the default run's rule.

    python benchmarks/step_profile.py [--steps 6] [--warmup 30] [--top 25] [--compare ROUNDS] [--block 6]
        [--out benchmarks/results/step_profile_cpu.md] [KEY=VALUE ...]   # optimus train overrides

Builds the Trainer exactly as `optimus train` does (same recipes, same CPU allocator and thread
settings), runs `--warmup` steps, times `--steps` steps with `profile.timers` on, then runs
`--profile-steps` more under torch.profiler. Prints (and writes as Markdown) the MFU against the
matmul probe, the profile.timers breakdown, the attention and FFN (for an MoE model: the expert path)
of the blocks timed alone, the self CPU time of op groups and of the top ops, and with `--compare`
this path against the previous one (the CPU 16-bit expert path switched off: whole-tensor schedule, expert GEMMs
on exact row counts), round-robin in one process. On a shared
CPU run it with OMP_NUM_THREADS=1 (see benchmarks/results/step_profile_cpu.md). Nothing is
asserted: this is a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from memory import ADAMW  # benchmarks/ is the script's directory, first on sys.path

from optimus.cpu_runtime import keep_cpu_allocations
from optimus.kernels import torch_backend
from optimus.peak_flops import cpu_matmul_probe
from optimus.recipes import load_config
from optimus.train.step import autocast_context
from optimus.train.trainer import Trainer

# Op-name substrings -> group. First match wins; a profiler range (record_function) of the
# model's modules is not used, since self CPU time of aten ops already sums to the step.
GROUPS = (
    ("attention (SDPA)", ("flash_attention", "scaled_dot_product")),
    ("cross-entropy", ("log_softmax", "nll_loss", "cross_entropy", "LinearCrossEntropy")),
    ("norms", ("rms_norm", "rsqrt")),
    ("expert GEMMs", ("grouped_mm",)),
    ("dense GEMMs", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")),
    ("optimizer", ("_foreach", "adam", "lerp")),
    ("copies/casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous")),
)


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def machine_line() -> str:
    flags = subprocess.run(
        "grep -o 'avx512[a-z_0-9]*\\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\\n' ' '",
        shell=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}; CPU flags: {flags}"


def build_trainer(overrides: list[str], run_dir: str) -> Trainer:
    cfg = load_config([*ADAMW, f"run.dir={run_dir}", "logging.progress=false", "profile.timers=true", *overrides])
    return Trainer.from_config(cfg)


def timed_steps(trainer: Trainer, n: int) -> tuple[list[float], dict[str, float]]:
    """Wall seconds of `n` steps and the mean profile.timers breakdown over them."""
    times, phases = [], defaultdict(float)
    for _ in range(n):
        trainer.timers.pop_totals()
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
        for key, seconds in trainer.timers.pop_totals().items():
            phases[key] += seconds / n
    return times, dict(phases)


def profile_steps(trainer: Trainer, n: int):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            trainer.train_step()
    return prof.key_averages()


def component_seconds(trainer: Trainer, reps: int = 3) -> dict[str, float]:
    """Forward + backward seconds per step of each kind of block part (attention with its norm, the FFN
    with its norm: the MoE layer's router, dispatch, experts and combine), each timed alone on the inputs
    it saw in one training step. Gradients are returned, not accumulated, so the model is left as it was."""
    captured: dict[str, list[tuple[torch.nn.Module, torch.Tensor]]] = defaultdict(list)
    hooks = []
    for block in trainer.model.layers.values():
        for name, norm, part in (("attention", block.attn_norm, block.attn), ("ffn", block.ffn_norm, block.ffn)):
            pair = torch.nn.Sequential(norm, part)
            hooks.append(
                norm.register_forward_hook(
                    lambda m, args, out, pair=pair, name=name: captured[name].append((pair, args[0].detach()))
                )
            )
    trainer.train_step()
    for hook in hooks:
        hook.remove()
    trainer.model.attach_router_stats(None)  # the parts alone record no routing statistics
    seconds: dict[str, float] = {}
    for name, calls in captured.items():
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for module, x in calls:
                x = x.requires_grad_()
                with autocast_context(trainer.cfg, trainer.platform):
                    out = module(x)
                params = [p for p in module.parameters() if p.requires_grad]
                torch.autograd.grad(out, [x, *params], torch.ones_like(out), allow_unused=True)
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times)
    trainer.model.attach_router_stats(trainer.router_stats)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    # Long enough for oneDNN's kernel cache to hold the expert GEMMs' row counts (optimus.kernels.cpu_schedules
    # .cached_rows): the first steps of a run build them.
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None, help="write the report as Markdown here")
    parser.add_argument(
        "--compare",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="then run ROUNDS round-robin rounds of a block of --block steps of this path and of the previous "
        "one (whole-tensor expert schedule, expert GEMMs on their exact row counts)",
    )
    parser.add_argument("--block", type=int, default=6, help="steps per variant and round of --compare")
    args, overrides = parser.parse_known_args()

    keep_cpu_allocations()  # as `optimus train` does on a CPU
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line)
        lines.append(line)

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(overrides, run_dir)
        cfg = trainer.cfg
        tokens = cfg.train.global_batch * cfg.train.seq_len
        timed_steps(trainer, args.warmup)
        times, phases = timed_steps(trainer, args.steps)
        # The probe again, after the steps: under load the start-up figure moves, and MFU moves with it.
        probe_after = cpu_matmul_probe(torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32)
        ops = profile_steps(trainer, args.profile_steps)
        parts = component_seconds(trainer)
        variants = {"now": [], "whole-tensor schedule, exact expert rows (the previous path)": []}
        cached = torch_backend._builds_kernel_per_shape
        for _ in range(args.compare):  # round-robin, so that load changes hit every variant alike
            for name, variant_times in variants.items():
                torch_backend._builds_kernel_per_shape = cached if name == "now" else lambda t: False
                # The block's first step runs on the kernels the other variant left in the cache: not counted.
                variant_times += timed_steps(trainer, args.block)[0][1:]
        torch_backend._builds_kernel_per_shape = cached
        trainer.loader.close()

    step_s = statistics.median(times)
    flops = trainer.flops_per_token * tokens
    emit(f"# Training-step profile: `optimus train {' '.join(overrides)}`".rstrip() + "")
    emit()
    emit(machine_line())
    emit()
    emit(
        f"dtype {cfg.train.dtype}, {tokens} tokens/step, {trainer.flops_per_token / 1e6:.2f} MFLOP/token, "
        f"median step {step_s * 1e3:.1f} ms over {args.steps} steps (min {min(times) * 1e3:.1f} ms), "
        f"{tokens / step_s:.0f} tokens/s"
    )
    for label, peak in (("start-up probe", trainer.peak_flops), ("probe after the steps", probe_after)):
        emit(
            f"- MFU vs {label} ({peak / 1e9:.0f} GFLOP/s): median {flops / step_s / peak:.1%}, "
            f"best step {flops / min(times) / peak:.1%}"
        )
    emit()
    emit("## profile.timers (mean seconds per step)")
    emit()
    emit("| phase | ms | share of step |")
    emit("|---|---|---|")
    mean_step = statistics.mean(times)
    for key, seconds in phases.items():
        emit(f"| {key} | {seconds * 1e3:.1f} | {seconds / mean_step:.1%} |")
    emit()

    emit("## Block parts timed alone (forward + backward per step, on the inputs of one step)")
    emit()
    emit("| part | ms per step | share of median step |")
    emit("|---|---|---|")
    for name, seconds in parts.items():
        emit(f"| {name} (with its RMSNorm) | {seconds * 1e3:.1f} | {seconds / step_s:.1%} |")
    emit()
    total_self = sum(e.self_cpu_time_total for e in ops)
    by_group: dict[str, float] = defaultdict(float)
    for e in ops:
        by_group[group_of(e.key)] += e.self_cpu_time_total
    emit(f"## Op groups by self CPU time ({args.profile_steps} profiled steps)")
    emit()
    emit("| group | ms per step | share |")
    emit("|---|---|---|")
    for group, us in sorted(by_group.items(), key=lambda kv: -kv[1]):
        emit(f"| {group} | {us / 1e3 / args.profile_steps:.1f} | {us / total_self:.1%} |")
    emit()
    emit(f"## Top {args.top} ops by self CPU time")
    emit()
    emit("| op | calls per step | self ms per step | share |")
    emit("|---|---|---|---|")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        emit(
            f"| `{e.key}` | {e.count / args.profile_steps:.0f} | "
            f"{e.self_cpu_time_total / 1e3 / args.profile_steps:.2f} | {e.self_cpu_time_total / total_self:.1%} |"
        )
    if args.compare:
        emit()
        emit(f"## This path against the previous one, {args.compare} round-robin rounds of {args.block} steps each")
        emit()
        emit(
            "the previous path: the CPU 16-bit expert path switched off (optimus.kernels.torch_backend."
            "_builds_kernel_per_shape), so the SwiGLU MLP runs each GEMM over all experts before the next pass "
            "(not one expert at a time) and each expert GEMM on the expert's own row count, a new oneDNN kernel for "
            "each new count (not on cached_rows); steps after the first of each block"
        )
        emit()
        emit("| variant | median step ms | step / now | MFU (start-up probe) |")
        emit("|---|---|---|---|")
        now = statistics.median(variants["now"])
        for name, variant_times in variants.items():
            median = statistics.median(variant_times)
            emit(f"| {name} | {median * 1e3:.1f} | {median / now:.3f} | {flops / median / trainer.peak_flops:.1%} |")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
