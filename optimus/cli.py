"""The `optimus` command: train, data, launch (and the subcommands later issues add).

`optimus train [overrides]` composes the Hydra config from `recipes/` with the
given overrides (`model=mula-7b-a1b train.steps=100 ...`), then trains: inside a
launcher (torchrun, srun, mpiexec) it joins the job, outside one with
`parallel.nproc=N` it starts N local processes through torch's elastic launcher.
"""

from __future__ import annotations

import os
import sys

# Before anything imports torch: its OpenMP runtime reads this once, as it loads. Threads that wait for the rest of
# their team then sleep instead of spinning; on cores that other processes share, a spinning thread holds the core
# the thread it waits for needs, and one process ran 5-8x slower than with sleeping threads (docs/ARCHITECTURE.md,
# "CPU threads"). A value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from optimus.config import ConfigError
from optimus.data.errors import DataError
from optimus.ranks import LaunchError, SpawnError
from optimus.recipes import load_config, recipe_groups, recipes_dir
from optimus.run_spec import RunSpec
from optimus.train.faults import TrainingDiverged

USAGE = """usage: optimus <command> [args]

Commands:
  train [overrides]     train a model from a Hydra recipe (default: the tiny model on the built-in corpus)
  data prepare|tokenizer  tokenise a corpus into token shards, or train a tokenizer
  launch                render (and submit) a PBS or SLURM job script for a recipe
  checkpoint export CKPT --out PATH  consolidate a sharded checkpoint into one safetensors file (--format hf: HF dir)
  checkpoint import HF_DIR --out CKPT  an Optimus checkpoint + model recipe from an OLMoE/Qwen3-MoE/Mixtral dir
  report RUN_DIR...     scaling-efficiency report (throughput, MFU, step-time breakdown) of a series of runs
  plan [overrides]      predicted memory per device and FLOPs per step of a recipe on a layout
  plan --predict [...]  predicted step time, MFU, time split and scaling (--nodes A,B,C) on the recipe's machine
  plan --dry-run [...]  one training step of the layout at its real size on fake tensors: memory, collectives

Run `optimus <command> --help` for the options of one command.
"""

TRAIN_HELP = """usage: optimus train [KEY=VALUE ...]

Trains a model. Settings come from the Hydra recipes in {recipes}; every
setting can be overridden on the command line as KEY=VALUE.

Recipe groups (pick one with GROUP=NAME):
{groups}
Frequently used keys (see ARCHITECTURE.md for all):
  model.n_layers, model.dim, model.n_heads, model.n_kv_heads, model.vocab_size
  model.moe.n_experts, model.moe.top_k, model.moe.expert_dim, model.moe.n_shared_experts
  model.moe.router=softmax|sigmoid, model.moe.capacity_factor=null|1.25
  model.qk_norm=full|head|none, model.moe.aux_loss_scope=micro_batch|global, model.moe.n_groups
  train.steps, train.global_batch, train.micro_batch, train.seq_len, train.dtype=bf16|fp32
  optim.lr, parallel.nproc, parallel.ep, parallel.dispatcher=alltoall|allgather
  parallel.pp, parallel.pp_schedule=gpipe|1f1b|interleaved_1f1b, parallel.pp_virtual
  kernels=auto|torch|triton, run.dir, logging.wandb=true

Examples:
  optimus train                                   # tiny MoE on the built-in corpus, a few minutes on a CPU
  optimus train train.steps=50 model.moe.router=sigmoid
  optimus train parallel.nproc=4 parallel.ep=2 train.micro_batch=2   # 4 local processes, experts split over pairs
  torchrun --nproc-per-node 8 -m optimus train model=mula-7b-a1b machine=nvidia \\
      train.micro_batch=1 train.global_batch=64
"""


def _worker(spec: RunSpec) -> dict:
    """Body of one rank: join the process group (if any), train, leave."""
    import torch.distributed as dist

    from optimus.platform import keep_cpu_allocations, quiet_gloo_alltoall_fallback, share_cpu_threads
    from optimus.ranks import discover, init_process_group
    from optimus.train.memory_check import check_cpu_memory
    from optimus.train.run_dir import remove_if_empty
    from optimus.train.trainer import Trainer

    info = discover()
    platform = spec.platform
    if platform.device_type == "cpu":
        check_cpu_memory(spec, info.local_world_size)
        share_cpu_threads(info.local_world_size)
        keep_cpu_allocations()
        quiet_gloo_alltoall_fallback()
    if info.world_size > 1:
        init_process_group(info, platform.backend, platform.device, spec.cfg.parallel.timeout_s)
    try:
        return Trainer(spec, info.local_rank).fit()
    except BaseException:
        remove_if_empty()  # a run that failed to start leaves no empty run directory behind
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawned_worker(spec: RunSpec) -> dict:
    """Body of a rank that `parallel.nproc=N` started, with the run its parent resolved: it detects only its own
    device. A user error goes to the parent, which says it once."""
    from optimus.platform import detect_platform
    from optimus.ranks import discover, report_user_error

    try:
        return _worker(spec.for_rank(detect_platform(spec.cfg.machine, discover().local_rank)))
    except (ConfigError, DataError, LaunchError) as err:
        report_user_error(str(err))
        raise SystemExit(2) from None


def cmd_train(overrides: list[str]) -> int:
    from optimus.platform import detect_platform
    from optimus.ranks import SpawnStopped, discover, spawn_local
    from optimus.run_spec import resolve_run
    from optimus.train.memory_check import check_cpu_memory

    cfg = load_config(overrides)
    info = discover()
    world_size = info.world_size if info.launcher != "none" else cfg.parallel.nproc
    spec = resolve_run(cfg, world_size, detect_platform(cfg.machine, info.local_rank))  # validated, here only
    if info.launcher == "none" and cfg.parallel.nproc > 1:
        if spec.platform.device_type == "cpu":  # the ranks would each refuse: say it once, before starting them
            check_cpu_memory(spec, cfg.parallel.nproc)
        try:
            summary = spawn_local(cfg.parallel.nproc, _spawned_worker, (spec,))[0]
        except SpawnStopped as stopped:  # what PBS/SLURM send before a kill: the ranks saved (or had nothing yet)
            how = "run the same command again" if cfg.run.dir else "run the command printed above"
            print(f"optimus: {stopped}; {how} to resume from the last checkpoint.")
            return stopped.exit_code
    else:
        summary = _worker(spec)
    if info.rank == 0 and summary:
        print(f"Finished {summary['steps']} steps; run directory: {summary['run_dir']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    # Lines from spawned ranks reach the terminal (or job log) as they are printed, not at exit.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command == "train":
            if any(a in ("-h", "--help") for a in rest):
                groups = "".join(f"  {g:<11}{', '.join(n)}\n" for g, n in recipe_groups().items())
                print(TRAIN_HELP.format(recipes=recipes_dir(), groups=groups))
                return 0
            return cmd_train(rest)
        if command == "data":
            from optimus.data.cli import main as data_main

            return data_main(rest)
        if command == "launch":
            from optimus.job_scripts import main as launch_main

            return launch_main(rest)
        if command == "checkpoint":
            from optimus.checkpoint_cli import main as checkpoint_main

            return checkpoint_main(rest)
        if command == "report":
            from optimus.report.cli import main as report_main

            return report_main(rest)
        if command == "plan" and "--dry-run" in rest:
            from optimus.dry_run import main as dry_run_main

            return dry_run_main(rest)
        if command == "plan" and "--predict" in rest:
            from optimus.perf.predict import main as predict_main

            return predict_main(rest)
        if command == "plan":
            from optimus.plan import main as plan_main

            return plan_main(rest)
    except (ConfigError, DataError, LaunchError) as err:  # LaunchError: the launcher's environment is incomplete
        print(f"optimus: error: {err}", file=sys.stderr)
        return 2
    except (SpawnError, TrainingDiverged) as err:  # a local worker failed, or the loss diverged
        print(f"optimus: error: {err}", file=sys.stderr)
        return 1
    print(f"optimus: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
