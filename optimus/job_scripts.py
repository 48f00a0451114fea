"""PBS and SLURM job scripts for a recipe: rendered, checked, written and submitted (`optimus launch`).

The scripts in `pbs/` and `slurm/` are complete job scripts, one per machine; rendering copies
one and rewrites its scheduler directives and its block of job settings (ranks per node, Python,
setup file, training arguments), after checking that the recipe's layout fits the nodes.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from optimus.config import ConfigError, OptimusConfig
from optimus.config_checks import validate

SCHEDULERS = {
    # scheduler: (directory, file suffix, directive prefix, submit command)
    "pbs": ("pbs", ".pbs", "#PBS", "qsub"),
    "slurm": ("slurm", ".sbatch", "#SBATCH", "sbatch"),
}
DEFAULT_SCHEDULER = {"aurora": "pbs", "frontier": "slurm", "nvidia": "slurm"}


def scripts_root() -> Path:
    """pbs/ and slurm/ ship inside the wheel (optimus/pbs) or sit at the repository root."""
    packaged = Path(__file__).parent
    return packaged if (packaged / "pbs").is_dir() else packaged.parent


def template_path(scheduler: str, machine: str) -> Path:
    directory, suffix, _, _ = SCHEDULERS[scheduler]
    path = scripts_root() / directory / f"{machine}{suffix}"
    if not path.is_file():
        known = sorted(p.stem for p in (scripts_root() / directory).glob(f"*{suffix}"))
        raise ConfigError(
            f"there is no {scheduler} job script for machine={machine} ({path} is missing): "
            f"choose machine={' or machine='.join(known) or '?'}, or add that script."
        )
    return path


def check_layout(cfg: OptimusConfig, nodes: int) -> int:
    """Validate the recipe for `nodes` nodes; returns the number of ranks."""
    rpn = cfg.machine.ranks_per_node
    if nodes < 1:
        raise ConfigError(f"--nodes={nodes} must be at least 1.")
    if not rpn:
        raise ConfigError(
            f"machine={cfg.machine.name} does not say how many ranks run per node: "
            "choose machine=aurora, frontier or nvidia, or set machine.ranks_per_node."
        )
    check_groups_in_node(cfg)
    world = nodes * rpn
    validate(cfg, world)
    return world


def check_groups_in_node(cfg: OptimusConfig) -> None:
    """A tensor-parallel group and an expert-parallel group each stay inside one node (`optimus plan --nodes`
    applies the same rule): both are runs of consecutive ranks, so each size must divide the ranks per node."""
    rpn = cfg.machine.ranks_per_node
    if not rpn:
        return
    groups = (("parallel.tp", cfg.parallel.tp, "tensor-parallel"), ("parallel.ep", cfg.parallel.ep, "expert-parallel"))
    for key, size, what in groups:
        if rpn % size:
            raise ConfigError(
                f"{key}={size} does not divide the {rpn} ranks per node of machine={cfg.machine.name}: "
                f"choose a {key[9:]} that divides {rpn}, so each {what} group stays inside one node."
            )


def default_run_dir(cfg: OptimusConfig) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir).expanduser().resolve()
    return Path("runs", f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def _directives(scheduler: str, nodes: int, job_name: str, account, queue, walltime: str, run_dir: Path) -> list[str]:
    if scheduler == "pbs":
        lines = [
            f"#PBS -N {job_name}",
            f"#PBS -l select={nodes}",
            "#PBS -l place=scatter",
            f"#PBS -l walltime={walltime}",
            "#PBS -l filesystems=home:flare",  # Aurora: the file systems the job needs mounted
            "#PBS -j oe",
            "#PBS -k doe",  # write the log straight to its final place, so it can be followed live
            f"#PBS -o {run_dir / 'job.log'}",
        ]
        lines += [f"#PBS -A {account}"] if account else []
        lines += [f"#PBS -q {queue}"] if queue else []
        return lines
    lines = [
        f"#SBATCH -J {job_name}",
        f"#SBATCH -N {nodes}",
        f"#SBATCH -t {walltime}",
        f"#SBATCH -o {run_dir / 'job-%j.log'}",
    ]
    lines += [f"#SBATCH -A {account}"] if account else []
    lines += [f"#SBATCH -p {queue}"] if queue else []
    return lines


def _check_directive_value(option: str, value: str | None, prefix: str) -> None:
    """A value written into a scheduler directive line, where quoting is not understood."""
    bad = next((ch for ch in value or "" if ch.isspace() or ch in "\"'#"), None)
    if bad is not None:
        what = "a space" if bad.isspace() else f"the character {bad!r}"
        raise ConfigError(
            f"{option} {value!r} contains {what}, which a {prefix} line cannot carry: choose a value without it "
            "(for a directory, a path or symbolic link without spaces)."
        )


def _directive_key(line: str) -> str:
    """What a directive sets: its option, and for PBS `-l` the resource ("-l walltime")."""
    words = line.split()
    option = words[1].split("=", 1)[0] if len(words) > 1 else ""
    if option == "-l" and len(words) > 2:
        return "-l " + words[2].split("=", 1)[0]
    return option


def _gpus_per_node(line: str, ranks_per_node: int) -> str:
    """One GPU per rank: the allocation's GPU request follows machine.ranks_per_node."""
    return re.sub(r"--gpus-per-node=\d+", f"--gpus-per-node={ranks_per_node}", line)


def _set_line(script: str, pattern: str, line: str) -> str:
    """Replace the one line of the template that matches `pattern` (a regex anchored at line start)."""
    new, count = re.subn(rf"^{pattern}.*$", lambda _: line, script, count=1, flags=re.M)
    if count != 1:
        raise RuntimeError(f"job script template has no line matching {pattern!r}")
    return new


def render(
    scheduler: str,
    nodes: int,
    cfg: OptimusConfig,
    overrides: list[str],
    account: str | None = None,
    queue: str | None = None,
    walltime: str = "01:00:00",
    run_dir: str | Path | None = None,
    job_name: str = "optimus",
    python: str | None = None,
    setup: str | None = None,
) -> str:
    """The job script that trains `cfg` (composed from `overrides`) on `nodes` nodes."""
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"--scheduler={scheduler} is not supported: choose pbs or slurm.")
    # PBS reads a bare number as seconds and SLURM as minutes: only the full form means the same to both.
    if not re.fullmatch(r"\d+:[0-5]\d:[0-5]\d", walltime):
        raise ConfigError(f"--walltime={walltime} is not a time: write it as HH:MM:SS (minutes and seconds below 60).")
    check_layout(cfg, nodes)
    template = template_path(scheduler, cfg.machine.name).read_text()
    run_dir = Path(run_dir).expanduser().resolve() if run_dir else default_run_dir(cfg)
    prefix = SCHEDULERS[scheduler][2]
    for option, value in (("--run-dir", str(run_dir)), ("--job-name", job_name), ("--account", account),
                          ("--queue", queue)):  # fmt: skip
        _check_directive_value(option, value, prefix)
    if setup and not Path(setup).is_file():
        raise ConfigError(f"--setup {setup} is not a file: give the shell file to source at job start.")
    args = [o for o in overrides if not o.startswith("run.dir=")] + [f"run.dir={run_dir}"]

    directives = _directives(scheduler, nodes, job_name, account, queue, walltime, run_dir)
    rendered_keys = {_directive_key(d) for d in directives}
    # The template's other directives (--exclusive, a GPU request) are the machine's own: keep them.
    kept = [
        _gpus_per_node(ln, cfg.machine.ranks_per_node)
        for ln in template.splitlines()
        if ln.startswith(prefix + " ") and _directive_key(ln) not in rendered_keys
    ]
    lines = [ln for ln in template.splitlines() if not ln.startswith(prefix + " ")]
    first_code = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    directives += kept
    script = "\n".join(lines[:first_code] + directives + lines[first_code:]) + "\n"

    script = _set_line(script, "RANKS_PER_NODE=", f"RANKS_PER_NODE={cfg.machine.ranks_per_node}")
    script = _set_line(script, "PYTHON=", f"PYTHON=${{OPTIMUS_PYTHON:-{shlex.quote(python or sys.executable)}}}")
    script = _set_line(script, "SETUP=", f"SETUP=${{OPTIMUS_SETUP:-{shlex.quote(setup) if setup else ''}}}")
    script = _set_line(script, r"read -r -a ARGS ", f"ARGS=({' '.join(shlex.quote(a) for a in args)})")
    if "CPU_BIND=" in script:  # Aurora: the binding follows the rank count
        bind, workers = aurora_cpu_bind(cfg.machine.ranks_per_node)
        script = _set_line(script, "CPU_BIND=", f'CPU_BIND="{bind}"')
        script = _set_line(script, "export CCL_WORKER_AFFINITY=", f'export CCL_WORKER_AFFINITY="{workers}"')
        threads = aurora_cores_per_rank(cfg.machine.ranks_per_node) - 1  # the block less the oneCCL worker's core
        script = _set_line(script, "export OMP_NUM_THREADS=", f"export OMP_NUM_THREADS={threads}  # the rank's cores")
    return script


def aurora_cores_per_rank(ranks_per_node: int, cores_per_socket: int = 52) -> int:
    """Cores in each rank's block (one of them for the oneCCL worker): 8, fewer when more ranks share a socket."""
    if ranks_per_node % 2:
        raise ConfigError(f"machine.ranks_per_node={ranks_per_node} must be even on Aurora: one half per socket.")
    block = min(8, (cores_per_socket - 1) // (ranks_per_node // 2))
    if block < 2:
        raise ConfigError(f"machine.ranks_per_node={ranks_per_node} leaves under 2 cores per rank on Aurora.")
    return block


def aurora_cpu_bind(ranks_per_node: int, cores_per_socket: int = 52) -> tuple[str, str]:
    """(mpiexec --cpu-bind list, CCL_WORKER_AFFINITY) for an Aurora node.

    Core 0 of each socket is the OS's; the first half of the ranks (tiles) sit on socket 0.
    Each rank gets a block of cores on its socket: one for the oneCCL worker, the rest for itself.
    """
    per_socket = ranks_per_node // 2
    block = aurora_cores_per_rank(ranks_per_node, cores_per_socket)
    ranges, workers = [], []
    for socket in range(2):
        for i in range(per_socket):
            first = socket * cores_per_socket + 1 + i * block
            workers.append(str(first))
            ranges.append(f"{first + 1}-{first + block - 1}")
    return "list:" + ":".join(ranges), ",".join(workers)


def check_submittable(cfg: OptimusConfig, scheduler: str, account: str | None) -> None:
    """What `--submit` needs, checked before anything is written: an account where the machine charges every
    job to a project (machine.account_required), and the scheduler's command."""
    if cfg.machine.account_required and not account:
        raise ConfigError(
            f"machine={cfg.machine.name} charges every job to a project: pass --account <project> with --submit."
        )
    command = SCHEDULERS[scheduler][3]
    if shutil.which(command) is None:
        raise ConfigError(
            f"{command} was not found on PATH: run `optimus launch --submit` on the cluster's login node, "
            "or leave out --submit to print the script."
        )


def write_job_script(path: Path, script: str) -> Path:
    """Write `script` to `path` (job.pbs / job.sbatch in the run directory), whole or not at all. Resubmitting a
    run (a requeue, a resume) writes there again: an earlier script that differs is kept as job.<n>.pbs (the
    lowest free n), so the record of what each earlier job ran is never replaced."""
    if path.exists() and path.read_text() != script:
        n = 1
        while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
            n += 1
        path.rename(kept)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(script)
    tmp.replace(path)
    return path


def submit(script_path: Path, scheduler: str) -> str:
    """Submit with qsub/sbatch from the current directory (check_submittable has passed); returns the
    scheduler's reply (the job id)."""
    command = SCHEDULERS[scheduler][3]
    done = subprocess.run([command, str(script_path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"{command} {script_path} failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout.strip()
