"""Job scripts from `optimus launch`: rendered, syntax-checked, and run against fake launchers."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from optimus import job_scripts
from optimus.commands import launch
from optimus.config import ConfigError, OptimusConfig
from optimus.recipes import load_config
from tests.unchanged import unchanged

ROOT = Path(__file__).resolve().parent.parent


def make_cfg(machine: str, ep: int = 1, n_experts: int = 24, global_batch: int = 6144) -> OptimusConfig:
    """The schema with one machine recipe from recipes/machine, as Hydra would compose it."""
    base = OmegaConf.structured(OptimusConfig)
    base.machine = OmegaConf.merge(base.machine, OmegaConf.load(ROOT / "recipes" / "machine" / f"{machine}.yaml"))
    base.model.moe.n_experts = n_experts
    base.parallel.ep = ep
    base.train.micro_batch = 1
    base.train.global_batch = global_batch
    return OmegaConf.to_object(base)


def write_exe(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fakes(tmp_path):
    """Fake mpiexec/srun that record their arguments and run the command as one rank, and a fake python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    skip_opts = (
        "while [[ $# -gt 0 && $1 == -* ]]; do case $1 in -n|-N|-c|--ppn|--cpu-bind) shift 2;; *) shift;; esac; done\n"
    )
    write_exe(
        bin_dir / "mpiexec",
        'printf "%s\\n" "$@" > "$FAKE_OUT/launcher.txt"\n'
        'env | grep -E "^(CCL_|FI_|ZE_|OMP_NUM)" | sort > "$FAKE_OUT/env.txt"\n'
        f'{skip_opts}PALS_LOCAL_RANKID=5 "$@"\n',
    )
    write_exe(
        bin_dir / "srun",
        'printf "%s\\n" "$@" > "$FAKE_OUT/launcher.txt"\n'
        'env | grep -E "^(NCCL_|FI_|MIOPEN_|OMP_NUM)" | sort > "$FAKE_OUT/env.txt"\n'
        f'{skip_opts}"$@"\n',
    )
    python = write_exe(
        bin_dir / "python",
        'printf "MASK=%s\\n" "$ZE_AFFINITY_MASK" > "$FAKE_OUT/python.txt"\n'
        'printf "%s\\n" "$@" >> "$FAKE_OUT/python.txt"\n',
    )
    return bin_dir, python


def run_script(script: str, tmp_path: Path, bin_dir: Path, extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_OUT": str(tmp_path), "HOME": str(tmp_path), **extra_env}
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done


def bash_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "syntax.sh"
    path.write_text(script)
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


@pytest.mark.parametrize("nodes", [1, 2, 256])
def test_pbs_aurora_script_launches_12_ranks_per_node(nodes, tmp_path, fakes):
    bin_dir, python = fakes
    cfg = make_cfg("aurora", ep=12)
    overrides = ["machine=aurora", "parallel.ep=12", "model.moe.n_experts=24", "train.global_batch=6144"]
    run_dir = tmp_path / "run"
    script = job_scripts.render("pbs", nodes, cfg, overrides, "MyProj", "prod", "02:00:00", run_dir, python=str(python))
    bash_syntax_ok(script, tmp_path)

    header = script.split("set -eo pipefail")[0]  # PBS reads directives only before the first command
    for directive in (f"-l select={nodes}", "-l walltime=02:00:00", "-A MyProj", "-q prod", f"-o {run_dir}/job.log"):
        assert f"#PBS {directive}\n" in header
    options = [job_scripts._directive_key(ln) for ln in header.splitlines() if ln.startswith("#PBS ")]
    assert sorted(options) == sorted(set(options)) and "-l filesystems" in options

    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"x4102c{i}s0b0n0.hsn.cm.aurora\n" for i in range(nodes)))
    pbs_env = {"PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(tmp_path)}
    run_script(script, tmp_path, bin_dir, pbs_env)

    launched = lines(tmp_path / "launcher.txt")
    bind, _ = job_scripts.aurora_cpu_bind(12)
    command = [str(python), "-m", "optimus", "train", *overrides, f"run.dir={run_dir}"]
    assert launched == ["-n", str(nodes * 12), "--ppn", "12", "--cpu-bind", bind, *command]
    assert lines(tmp_path / "python.txt") == ["MASK=", *command[1:]]  # every rank sees all tiles
    env = dict(line.split("=", 1) for line in lines(tmp_path / "env.txt"))
    _, workers = job_scripts.aurora_cpu_bind(12)
    assert env["CCL_WORKER_COUNT"] == "1" and env["CCL_WORKER_AFFINITY"] == workers
    assert env["CCL_ATL_TRANSPORT"] == "mpi" and env["CCL_KVS_USE_MPI_RANKS"] == "1"
    assert env["CCL_KVS_GET_TIMEOUT"] == "600" and env["ZE_FLAT_DEVICE_HIERARCHY"] == "FLAT"
    assert int(env["CCL_ZE_CACHE_OPEN_IPC_HANDLES_THRESHOLD"]) >= 1024
    for key in ("FI_CXI_DEFAULT_CQ_SIZE", "FI_CXI_OVFLOW_BUF_SIZE", "FI_CXI_CQ_FILL_PERCENT", "FI_MR_CACHE_MONITOR"):
        assert env[key]

    # With OPTIMUS_MASK_TILES=1 a wrapper shows each rank (here local rank 5) only its own tile.
    run_script(script, tmp_path, bin_dir, {**pbs_env, "OPTIMUS_MASK_TILES": "1"})
    launched = lines(tmp_path / "launcher.txt")
    assert launched[6:8] == ["bash", "-c"] and launched[9:] == ["set-tile", *command]
    assert lines(tmp_path / "python.txt") == ["MASK=5", *command[1:]]


@pytest.mark.parametrize("nodes", [1, 2, 256])
def test_slurm_frontier_script_launches_8_ranks_per_node(nodes, tmp_path, fakes):
    bin_dir, python = fakes
    cfg = make_cfg("frontier", ep=8)
    overrides = ["machine=frontier", "parallel.ep=8", "train.global_batch=6144", "data.path='my file.txt'"]
    run_dir = tmp_path / "run"
    script = job_scripts.render(
        "slurm", nodes, cfg, overrides, "ABC123", "batch", "00:30:00", run_dir, python=str(python)
    )
    bash_syntax_ok(script, tmp_path)

    header = script.split("set -eo pipefail")[0]
    for directive in (f"-N {nodes}", "-t 00:30:00", "-A ABC123", "-p batch", f"-o {run_dir}/job-%j.log",
                      "--signal=USR1@300"):  # fmt: skip
        assert f"#SBATCH {directive}\n" in header

    run_script(script, tmp_path, bin_dir, {"SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_ID": "77", "USER": "me"})
    launched = lines(tmp_path / "launcher.txt")
    expected_opts = ["-N", str(nodes), "-n", str(nodes * 8), "--ntasks-per-node=8", "--gpus-per-node=8"]
    assert launched[:9] == [*expected_opts, "--gpu-bind=closest", "-c", "7"]
    assert launched[9:] == [str(python), "-m", "optimus", "train", *overrides, f"run.dir={run_dir}"]
    env = dict(line.split("=", 1) for line in lines(tmp_path / "env.txt"))
    assert env["NCCL_NET_GDR_LEVEL"] == "3"
    assert env["FI_MR_CACHE_MONITOR"] == "userfaultfd"
    assert env["FI_CXI_ATS"] == "0"
    assert env["OMP_NUM_THREADS"] == "7"
    assert env["MIOPEN_USER_DB_PATH"].startswith("/tmp/") and env["MIOPEN_CUSTOM_CACHE_DIR"].startswith("/tmp/")


def test_nvidia_slurm_script_renders_and_runs(tmp_path, fakes):
    bin_dir, python = fakes
    cfg = make_cfg("nvidia", ep=8, global_batch=16)
    script = job_scripts.render("slurm", 2, cfg, ["machine=nvidia"], run_dir=tmp_path / "run", python=str(python))
    bash_syntax_ok(script, tmp_path)
    header = script.split("set -eo pipefail")[0]
    # The template's own requests survive rendering, and no option is given twice.
    assert "#SBATCH --exclusive\n" in header and "#SBATCH --gpus-per-node=8\n" in header
    options = [job_scripts._directive_key(ln) for ln in header.splitlines() if ln.startswith("#SBATCH ")]
    assert sorted(options) == sorted(set(options)) and "-N" in options
    run_script(script, tmp_path, bin_dir, {"SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_ON_NODE": "96"})
    launched = lines(tmp_path / "launcher.txt")
    assert launched[:9] == ["-N", "2", "-n", "16", "--ntasks-per-node=8", "--gpus-per-node=8"] + [
        "--gpu-bind=closest",
        "-c",
        "12",
    ]


def test_unrendered_templates_run_standalone(tmp_path, fakes):
    """The files in pbs/ and slurm/ are submittable as they are, with OPTIMUS_ARGS."""
    bin_dir, python = fakes
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("h0\nh1\nh0\n")  # duplicates count once
    common = {"OPTIMUS_ARGS": "machine=aurora train.steps=5", "OPTIMUS_PYTHON": str(python)}
    run_script((ROOT / "pbs" / "aurora.pbs").read_text(), tmp_path, bin_dir, {"PBS_NODEFILE": str(nodefile), **common})
    assert lines(tmp_path / "launcher.txt")[:4] == ["-n", "24", "--ppn", "12"]
    assert lines(tmp_path / "python.txt")[-2:] == ["machine=aurora", "train.steps=5"]

    common["OPTIMUS_ARGS"] = "machine=frontier"
    run_script(
        (ROOT / "slurm" / "frontier.sbatch").read_text(), tmp_path, bin_dir, {"SLURM_JOB_NUM_NODES": "3", **common}
    )
    assert lines(tmp_path / "launcher.txt")[:4] == ["-N", "3", "-n", "24"]


def test_aurora_binding_matches_the_template_and_is_disjoint():
    template = (ROOT / "pbs" / "aurora.pbs").read_text()
    bind, workers = job_scripts.aurora_cpu_bind(12)
    assert f'CPU_BIND="{bind}"' in template
    assert f'CCL_WORKER_AFFINITY="{workers}"' in template
    for rpn in (2, 4, 6, 8, 12, 24):
        bind, workers = job_scripts.aurora_cpu_bind(rpn)
        ranges = bind.removeprefix("list:").split(":")
        assert len(ranges) == rpn and len(workers.split(",")) == rpn
        used = [int(w) for w in workers.split(",")]
        for r in ranges:
            lo, hi = map(int, r.split("-"))
            used += range(lo, hi + 1)
        assert len(used) == len(set(used)), "a core is given twice"
        assert not {0, 52} & set(used) and max(used) < 104, "OS cores or cores beyond the node used"
        # The first half of the ranks (tiles 0-5 for 12) sits on socket 0.
        firsts = [int(r.split("-")[0]) for r in ranges]
        assert all(f < 52 for f in firsts[: rpn // 2]) and all(f > 52 for f in firsts[rpn // 2 :])
        # The rank's threads fill its block, less the oneCCL worker's core.
        lo, hi = map(int, ranges[0].split("-"))
        assert job_scripts.aurora_cores_per_rank(rpn) - 1 == hi - lo + 1


def test_aurora_threads_follow_the_ranks_per_node(tmp_path):
    cfg = make_cfg("aurora", ep=12)
    cfg.machine.ranks_per_node = 24  # two ranks per tile: 25 usable cores per socket over 12 ranks
    script = job_scripts.render("pbs", 1, cfg, ["machine=aurora"], run_dir=tmp_path / "run")
    assert "export OMP_NUM_THREADS=3 " in script  # blocks of 4 cores, one for the oneCCL worker


def test_layout_errors_are_one_clear_sentence():
    with pytest.raises(ConfigError, match=r"parallel.ep=8 does not divide the 12 ranks per node"):
        job_scripts.render("pbs", 2, make_cfg("aurora", ep=8), [])
    with pytest.raises(ConfigError, match=r"machine=local does not say how many ranks"):
        job_scripts.render("slurm", 2, make_cfg("local"), [])
    with pytest.raises(ConfigError, match=r"train.global_batch=16 is not divisible"):
        job_scripts.render("pbs", 256, make_cfg("aurora", ep=12, global_batch=16), [])
    with pytest.raises(ConfigError, match=r"there is no pbs job script for machine=frontier"):
        job_scripts.render("pbs", 1, make_cfg("frontier", ep=8), [])
    with pytest.raises(ConfigError, match=r"--walltime=2h"):
        job_scripts.render("pbs", 1, make_cfg("aurora", ep=12), [], walltime="2h")
    with pytest.raises(ConfigError, match=r"--nodes=0"):
        job_scripts.render("pbs", 0, make_cfg("aurora", ep=12), [])


def test_main_prints_the_script_and_where_results_go(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(launch, "load_config", lambda overrides: make_cfg("aurora", ep=12))
    run_dir = tmp_path / "r"
    code = launch.main(["--nodes", "2", "--run-dir", str(run_dir), "machine=aurora", "parallel.ep=12"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out.startswith("#!/bin/bash") and "#PBS -l select=2" in out  # scheduler picked from the machine
    assert "ARGS=(machine=aurora parallel.ep=12 run.dir=" in out
    assert "24 ranks" in err and str(run_dir / "metrics.jsonl") in err
    assert not run_dir.exists(), "printing must not create the run directory"


def test_main_submit_writes_into_run_dir_and_calls_sbatch(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(launch, "load_config", lambda overrides: make_cfg("frontier", ep=8))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(bin_dir / "sbatch", f'echo "$@" > {tmp_path}/sbatch_args.txt\necho "Submitted batch job 4242"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    code = launch.main(
        ["--nodes", "2", "--submit", "--account", "abc123", "--run-dir", str(run_dir), "machine=frontier"]
    )
    out = capsys.readouterr().out
    assert code == 0
    script_path = run_dir / "job.sbatch"
    assert (tmp_path / "sbatch_args.txt").read_text().strip() == str(script_path)
    assert "#SBATCH -N 2" in script_path.read_text() and "#SBATCH -A abc123" in script_path.read_text()
    assert "Submitted batch job 4242" in out and str(run_dir / "metrics.jsonl") in out


def test_resubmitting_keeps_each_earlier_script_that_differs(tmp_path):
    path = tmp_path / "job.pbs"
    job_scripts.write_job_script(path, "first\n")
    job_scripts.write_job_script(path, "first\n")  # the same script again: nothing to keep
    job_scripts.write_job_script(path, "second\n")
    job_scripts.write_job_script(path, "third\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.1.pbs", "job.2.pbs", "job.pbs"]
    assert [(tmp_path / n).read_text() for n in ("job.1.pbs", "job.2.pbs", "job.pbs")] == [
        "first\n",
        "second\n",
        "third\n",
    ]


def test_submit_without_the_scheduler_command_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "load_config", lambda overrides: make_cfg("aurora", ep=12))
    monkeypatch.setenv("PATH", str(tmp_path))  # no qsub anywhere
    with unchanged(tmp_path), pytest.raises(ConfigError, match=r"qsub was not found on PATH"):
        launch.main(["--nodes", "1", "--submit", "--account", "abc", "--run-dir", str(tmp_path / "run")])


@pytest.mark.parametrize("machine,scheduler,ep", [("aurora", "qsub", 12), ("frontier", "sbatch", 8)])
def test_submit_without_an_account_is_refused_where_the_machine_charges_one(
    machine, scheduler, ep, monkeypatch, tmp_path
):
    """Aurora and Frontier charge every job to a project: a script without -A is refused before anything is
    written or submitted (a fake qsub/sbatch records whether it was called)."""
    monkeypatch.setattr(launch, "load_config", lambda overrides: make_cfg(machine, ep=ep))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(bin_dir / scheduler, f'echo "$@" > {tmp_path}/submitted.txt\necho "4242"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    argv = ["--nodes", "1", "--submit", "--run-dir", str(tmp_path / "run")]
    with unchanged(tmp_path), pytest.raises(ConfigError) as refused:
        launch.main(argv)
    assert str(refused.value) == (
        f"machine={machine} charges every job to a project: pass --account <project> with --submit."
    )
    assert launch.main([*argv, "--account", "abc"]) == 0  # the same command with an account goes through
    suffix = job_scripts.SCHEDULERS[job_scripts.DEFAULT_SCHEDULER[machine]][1]
    assert (tmp_path / "submitted.txt").exists() and "-A abc" in (tmp_path / "run" / f"job{suffix}").read_text()


def test_machines_without_a_required_account_submit_without_one(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "load_config", lambda overrides: make_cfg("nvidia", ep=8))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(bin_dir / "sbatch", 'echo "Submitted batch job 7"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert launch.main(["--nodes", "1", "--submit", "--run-dir", str(tmp_path / "run")]) == 0
    assert "#SBATCH -A" not in (tmp_path / "run" / "job.sbatch").read_text()


def test_values_a_directive_cannot_carry_are_refused(tmp_path):
    cfg = make_cfg("aurora", ep=12)
    spaced = tmp_path / "my runs" / "a"
    for scheduler in ("pbs", "slurm"):
        with pytest.raises(ConfigError, match=r"--run-dir .* contains a space, which a #(PBS|SBATCH) line"):
            job_scripts.render(
                scheduler, 1, make_cfg("frontier", ep=8) if scheduler == "slurm" else cfg, [], run_dir=spaced
            )
    with pytest.raises(ConfigError, match=r"--job-name 'my job' contains a space"):
        job_scripts.render("pbs", 1, cfg, [], run_dir=tmp_path, job_name="my job")
    with pytest.raises(ConfigError, match=r"--setup .* is not a file"):
        job_scripts.render("pbs", 1, cfg, [], run_dir=tmp_path, setup=str(tmp_path / "missing.sh"))
    for walltime in ("60", "1:99:00", "01:00:60", "1:00"):  # a bare number is seconds to PBS, minutes to SLURM
        with pytest.raises(ConfigError, match=r"--walltime=.* HH:MM:SS"):
            job_scripts.render("pbs", 1, cfg, [], run_dir=tmp_path, walltime=walltime)
    setup = tmp_path / "env.sh"
    setup.write_text("true\n")
    script = job_scripts.render("pbs", 1, cfg, [], run_dir=tmp_path, walltime="100:30:00", setup=str(setup))
    assert "#PBS -l walltime=100:30:00" in script and f"SETUP=${{OPTIMUS_SETUP:-{setup}}}" in script


def test_plan_and_launch_agree_on_the_expert_group_of_a_node(capsys):
    from optimus.cli import main

    args = ["machine=aurora", "model.moe.n_experts=8", "parallel.ep=8", "train.micro_batch=1", "train.global_batch=96"]
    assert main(["plan", "--nodes", "4", *args]) == 2
    plan_error = capsys.readouterr().err
    assert main(["launch", "--nodes", "4", *args]) == 2
    assert capsys.readouterr().err == plan_error and "does not divide the 12 ranks per node" in plan_error
    assert main(["plan", "--nodes", "4", *args[:2], "parallel.ep=4", *args[3:]]) == 0


@pytest.mark.parametrize(
    "experiment,pp,ep", [("aurora-mula-100b-a7b", 8, 12), ("aurora-mula-220b-a10b", 8, 12)], ids=["100b", "220b"]
)
def test_pipeline_experiments_render_and_launch_on_256_aurora_nodes(experiment, pp, ep, tmp_path, fakes, capsys):
    """The full-size recipes, composed as `optimus launch` composes them: 3072 ranks, PP x DP x EP."""
    bin_dir, python = fakes
    run_dir = tmp_path / "run"
    argv = ["--nodes", "256", "--run-dir", str(run_dir), "--python", str(python), f"experiment={experiment}"]
    assert launch.main(argv) == 0
    script, notes = capsys.readouterr()
    assert f"pipeline: {pp} stages of {3072 // pp} ranks ({256 / pp:g} nodes) each" in notes
    bash_syntax_ok(script, tmp_path)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"x4102c{i}s0b0n0.hsn.cm.aurora\n" for i in range(256)))
    run_script(script, tmp_path, bin_dir, {"PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(tmp_path)})
    command = [str(python), "-m", "optimus", "train", f"experiment={experiment}", f"run.dir={run_dir}"]
    assert lines(tmp_path / "launcher.txt")[:4] == ["-n", "3072", "--ppn", "12"]
    assert lines(tmp_path / "launcher.txt")[-len(command) :] == command
    cfg = load_config([f"experiment={experiment}"])
    assert (cfg.parallel.pp, cfg.parallel.ep) == (pp, ep)


def test_tensor_parallel_group_stays_in_a_node(capsys):
    """A TP group is a run of consecutive ranks: tp must divide the ranks per node; plan and launch agree."""
    from optimus.cli import main

    cfg = make_cfg("frontier", n_experts=0, global_batch=64)
    cfg.parallel.tp = 16
    with pytest.raises(ConfigError, match=r"parallel.tp=16 does not divide the 8 ranks per node of machine=frontier"):
        job_scripts.render("slurm", 4, cfg, [])
    args = [
        "machine=frontier",
        "model.moe.n_experts=0",
        "parallel.tp=3",
        "train.micro_batch=1",
        "train.global_batch=96",
    ]
    assert main(["plan", "--nodes", "3", *args]) == 2
    plan_error = capsys.readouterr().err
    assert main(["launch", "--nodes", "3", *args]) == 2
    assert capsys.readouterr().err == plan_error and "so each tensor-parallel group stays inside one node" in plan_error


FRONTIER_EXPERIMENTS = {  # experiment: (nodes, tp, pp, ep)
    "frontier-22b": (16, 2, 4, 1),
    "frontier-175b": (128, 4, 16, 1),
    "frontier-1t": (384, 8, 64, 1),
    "frontier-mula-20b-a2b": (384, 1, 8, 2),
    "frontier-mula-100b-a7b": (384, 2, 8, 8),
    "frontier-mula-220b-a10b": (384, 1, 16, 8),
}


@pytest.mark.parametrize("experiment", sorted(FRONTIER_EXPERIMENTS))
def test_frontier_experiments_render_and_launch(experiment, tmp_path, fakes, capsys):
    """The Frontier recipes, composed as `optimus launch` composes them: 8 ranks per node, PP x DP x TP."""
    bin_dir, python = fakes
    nodes, tp, pp, ep = FRONTIER_EXPERIMENTS[experiment]
    run_dir = tmp_path / "run"
    argv = ["--nodes", str(nodes), "--run-dir", str(run_dir), "--python", str(python), f"experiment={experiment}"]
    assert launch.main(argv) == 0
    script, notes = capsys.readouterr()
    ranks = nodes * 8
    assert (f"pipeline: {pp} stages of {ranks // pp} ranks" in notes) == (pp > 1)
    tp_note = f"tensor parallel: groups of {tp} consecutive ranks, {ranks // (pp * tp)} data-parallel ranks per stage"
    assert (tp_note in notes) == (tp > 1)
    bash_syntax_ok(script, tmp_path)
    assert f"#SBATCH -N {nodes}\n" in script.split("set -eo pipefail")[0]
    run_script(script, tmp_path, bin_dir, {"SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_ID": "7", "USER": "me"})
    launched = lines(tmp_path / "launcher.txt")
    assert launched[:6] == ["-N", str(nodes), "-n", str(ranks), "--ntasks-per-node=8", "--gpus-per-node=8"]
    assert launched[-2:] == [f"experiment={experiment}", f"run.dir={run_dir}"]
    cfg = load_config([f"experiment={experiment}"])
    assert (cfg.machine.name, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep) == ("frontier", tp, pp, ep)
