"""`optimus launch`: its options, and the summary it prints beside the job script it renders (and submits).

Rendering, the checks and submitting are optimus.job_scripts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from optimus.config import ConfigError
from optimus.config_checks import layout_of
from optimus.job_scripts import (
    DEFAULT_SCHEDULER,
    SCHEDULERS,
    check_submittable,
    default_run_dir,
    render,
    submit,
    write_job_script,
)
from optimus.recipes import load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="optimus launch",
        description="Render a PBS (Aurora) or SLURM (Frontier, NVIDIA) job script that runs `optimus train` "
        "with the given overrides; print it, or write it into the run directory and submit it.",
    )
    p.add_argument("--scheduler", choices=sorted(SCHEDULERS), help="default: pbs for aurora, slurm otherwise")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument("--submit", action="store_true", help="write <run-dir>/job.<suffix> and submit it")
    p.add_argument("--account", help="project to charge (-A)")
    p.add_argument("--queue", help="queue (PBS -q) or partition (SLURM -p)")
    p.add_argument("--walltime", default="01:00:00", help="HH:MM:SS (default 01:00:00)")
    p.add_argument("--run-dir", help="run directory (default: run.dir, or runs/<model>-<time>)")
    p.add_argument("--job-name", default="optimus")
    p.add_argument("--python", help="Python that runs on the nodes (default: this one)")
    p.add_argument("--setup", help="shell file sourced at job start (modules, virtual environment)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for `optimus train`")
    return p


def main(argv: list[str]) -> int:
    opts = _parser().parse_intermixed_args(argv)
    cfg = load_config(opts.overrides)
    scheduler = opts.scheduler or DEFAULT_SCHEDULER.get(cfg.machine.name)
    if scheduler is None:
        raise ConfigError(f"machine={cfg.machine.name} has no default scheduler: pass --scheduler pbs or slurm.")
    run_dir = Path(opts.run_dir).expanduser().resolve() if opts.run_dir else default_run_dir(cfg)
    setup = str(Path(opts.setup).expanduser().resolve()) if opts.setup else None
    script = render(
        scheduler,
        opts.nodes,
        cfg,
        opts.overrides,
        opts.account,
        opts.queue,
        opts.walltime,
        run_dir,
        opts.job_name,
        opts.python,
        setup,
    )
    ranks = opts.nodes * cfg.machine.ranks_per_node
    layout = layout_of(cfg, ranks)
    pp, tp = layout.pp, layout.tp
    # PP is the outermost rank dimension (each stage a run of consecutive nodes), TP the innermost (each group a
    # run of consecutive ranks in a node).
    stages = f"pipeline: {pp} stages of {layout.stage_size} ranks ({opts.nodes / pp:g} nodes) each\n" if pp > 1 else ""
    if tp > 1:
        stages += f"tensor parallel: groups of {tp} consecutive ranks, {layout.dp} data-parallel ranks per stage\n"
    where = (
        f"{opts.nodes} nodes x {cfg.machine.ranks_per_node} = {ranks} ranks of machine={cfg.machine.name}\n{stages}"
        f"run directory: {run_dir}\n"
        f"  job log:  {run_dir / ('job.log' if scheduler == 'pbs' else 'job-<jobid>.log')}\n"
        f"  metrics:  {run_dir / 'metrics.jsonl'}  (config.yaml, run_info.json beside it)"
    )
    if not opts.submit:
        print(script, end="")
        note = f"{where}\nnot submitted: add --submit, or save this script, mkdir -p {run_dir} and submit it yourself"
        print("# " + note.replace("\n", "\n# "), file=sys.stderr)
        return 0
    check_submittable(cfg, scheduler, opts.account)
    run_dir.mkdir(parents=True, exist_ok=True)  # the scheduler writes the job log here
    script_path = write_job_script(run_dir / f"job{SCHEDULERS[scheduler][1]}", script)
    reply = submit(script_path, scheduler)
    print(f"submitted {script_path}: {reply}\n{where}")
    return 0
