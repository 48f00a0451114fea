"""The `optimus` command: train, data, launch (and the subcommands later issues add).

`optimus train [overrides]` composes the Hydra config from `recipes/` with the
given overrides (`model=mula-7b-a1b train.steps=100 ...`), then trains: inside a
launcher (torchrun, srun, mpiexec) it joins the job, outside one with
`parallel.nproc=N` it starts N local processes through torch's elastic launcher.
"""

from __future__ import annotations

import os
import signal
import sys

from optimus.stop_signals import StopRequested, ignore_stop_signals, stop_signals_raise, stopped

# Before anything imports torch: its OpenMP runtime reads this once, as it loads. Threads that wait for the rest of
# their team then sleep instead of spinning; on cores that other processes share, a spinning thread holds the core
# the thread it waits for needs, and one process ran 5-8x slower than with sleeping threads (docs/ARCHITECTURE.md,
# "CPU threads"). A value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Nothing here imports torch (or what imports it) at import time: `main` first takes charge of stop signals, so that
# a Ctrl-C during the seconds of those imports ends in one line too.


def __getattr__(name: str):
    """`optimus.cli.load_config`, which scripts and tests import from here, loaded on first use (see above)."""
    if name == "load_config":
        from optimus.recipes import load_config

        return load_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
  plan --calibrate --out DIR  this node's measured rates and links as a machine recipe, DIR/machine.yaml
  selftest [--out DIR]  check this node's kernels and collectives against references, measure its rates

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


def cmd_train(overrides: list[str]) -> int:
    from optimus.local_launcher import SpawnStopped, spawn_local
    from optimus.platform import detect_platform
    from optimus.ranks import discover
    from optimus.recipes import load_config
    from optimus.run_spec import resolve_run
    from optimus.train.memory_check import check_cpu_memory
    from optimus.train.rank import run_rank, run_spawned_rank

    cfg = load_config(overrides)
    info = discover()
    world_size = info.world_size if info.launcher != "none" else cfg.parallel.nproc
    spec = resolve_run(cfg, world_size, detect_platform(cfg.machine, info.local_rank))  # validated, here only
    spawning = info.launcher == "none" and cfg.parallel.nproc > 1
    if spec.platform.device_type == "cpu":  # this node's ranks must fit in its memory: said once, before they start
        check_cpu_memory(spec, cfg.parallel.nproc if spawning else info.local_world_size)
    if spawning:
        try:
            summary = spawn_local(cfg.parallel.nproc, run_spawned_rank, (spec,))[0]
        except SpawnStopped as stopped:  # ended by a stop signal; where they saved first, they said so
            ignore_stop_signals()
            if not stopped.saved:
                print(f"optimus: {stopped}.", file=sys.stderr)
            return stopped.exit_code
    else:
        summary = run_rank(spec)
    if summary and "stopped_by" in summary:  # it has said where it saved and how to resume: nothing to add
        ignore_stop_signals()
    elif info.rank == 0 and summary:
        print(f"Finished {summary['steps']} steps; run directory: {summary['run_dir']}")
    return 0


def _command(command: str, rest: list[str]) -> int:
    """Run one command; its user errors and failures as one line each."""
    from optimus.config import ConfigError
    from optimus.data.errors import DataError
    from optimus.local_launcher import SpawnError
    from optimus.ranks import LaunchError
    from optimus.train.faults import TrainingDiverged

    try:
        if command == "train":
            if any(a in ("-h", "--help") for a in rest):
                from optimus.recipes import recipe_groups, recipes_dir

                groups = "".join(f"  {g:<11}{', '.join(n)}\n" for g, n in recipe_groups().items())
                print(TRAIN_HELP.format(recipes=recipes_dir(), groups=groups))
                return 0
            return cmd_train(rest)
        if command == "data":
            from optimus.commands.data import main as data_main

            return data_main(rest)
        if command == "launch":
            from optimus.commands.launch import main as launch_main

            return launch_main(rest)
        if command == "checkpoint":
            from optimus.commands.checkpoint import main as checkpoint_main

            return checkpoint_main(rest)
        if command == "report":
            from optimus.commands.report import main as report_main

            return report_main(rest)
        if command == "selftest":
            from optimus.commands.selftest import main as selftest_main

            return selftest_main(rest)
        if command == "plan":  # its modes (--dry-run, --predict, --calibrate) are routed by its own parser
            from optimus.commands.plan import main as plan_main

            return plan_main(rest)
    except (ConfigError, DataError, LaunchError) as err:  # LaunchError: the launcher's environment is incomplete
        print(f"optimus: error: {err}", file=sys.stderr)
        return 2
    except (SpawnError, TrainingDiverged) as err:  # a local worker failed, or the loss diverged
        print(f"optimus: error: {err}", file=sys.stderr)
        return 1
    print(f"optimus: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------
# A closed output (stop signals: optimus.stop_signals): one line (or none), never a traceback


def _reader_gone() -> int:
    """Standard output is a pipe whose reader has gone (`optimus train --help | head`): nothing more can be
    shown, and the interpreter's last flush would fail again; end as `yes | head` does, without a word."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    # Lines from spawned ranks reach the terminal (or job log) as they are printed, not at exit.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    whole_process = argv is None  # the process's own command line (`optimus ...`), not a call from Python
    argv = list(sys.argv[1:] if argv is None else argv)
    with stop_signals_raise(whole_process):
        try:
            if not argv or argv[0] in ("-h", "--help", "help"):
                print(USAGE)
                code = 0
            else:
                code = _command(argv[0], argv[1:])
            sys.stdout.flush()  # where the output is buffered, a reader that has gone shows here
            return code
        except BrokenPipeError:
            return _reader_gone()
        except (KeyboardInterrupt, StopRequested) as stop:
            return stopped(stop)


if __name__ == "__main__":
    sys.exit(main())
