"""The commands: `optimus selftest` and `optimus plan --calibrate`, their options, and their processes.

Both compose the recipe from the overrides as `optimus train` does and run one process per device of this
node: inside a launcher (torchrun, srun, mpiexec) the processes it started, of one node; elsewhere `--nproc N`
local processes, by default one per visible GPU (one on a CPU). Rank 0 gathers every rank's results, prints
the table and writes the files.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform as python_platform
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from optimus.config import TORCH_DTYPES, ConfigError, MachineConfig, OptimusConfig
from optimus.config_checks import validate_machine_and_data, validate_model
from optimus.cpu_runtime import keep_cpu_allocations, share_cpu_threads
from optimus.errors import check_choice
from optimus.kernels import BACKENDS, KernelUnavailable, get_backend
from optimus.layout import experts_per_rank
from optimus.local_launcher import SpawnStopped, report_user_error, spawn_local
from optimus.output_dir import check_out_dir, replacing_directory
from optimus.perf.op_timing import time_signatures
from optimus.platform import Platform, declared_device_type, detect_platform, resolve_dtype
from optimus.ranks import RankInfo, discover, init_process_group
from optimus.selftest import report as rp
from optimus.selftest.collectives import run_collectives
from optimus.selftest.kernels import DENSE, check_kernels, kernel_cases
from optimus.selftest.rates import measure_rates

DEVICE_TYPES = ("cpu", "cuda", "xpu")
ONE_PROCESS = "none measured: one process has no peer (run one process per device: --nproc N, or under a launcher)"


@dataclass(frozen=True)
class Output:
    """What a command writes into --out: `marker` tells an earlier output of its kind (check_out_dir)."""

    command: str
    marker: str
    files: tuple[str, ...]
    what: str


SELFTEST = Output("optimus selftest", "selftest.json", ("selftest.json", "machine.yaml"), "a selftest's output")
CALIBRATE = Output(
    "optimus plan --calibrate", "machine.yaml", ("machine.yaml", "operators.json"), "a calibration's output"
)


@dataclass(frozen=True)
class Job:
    """What every rank runs: the recipe (machine.device set from --device), the one device --device names (else
    each rank takes its local rank's), the kernel backend to check (None: rates and collectives only), the
    compute dtype train.dtype resolves to on that device, and the operators to time (a calibration's: the
    distinct signatures of the traced step `step` describes, optimus.perf.op_timing)."""

    cfg: OptimusConfig
    device_index: int | None
    kernels: str | None
    compute_dtype: str
    signatures: tuple[str, ...] = ()
    step: str | None = None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="optimus selftest",
        description="Check this node's expert-path kernels and collectives against exact references, and measure "
        "the rates the performance model assumes (GEMM, memory bandwidth, kernel floor, intra-node links).",
    )
    p.add_argument("--device", help="cpu, cuda or xpu (one process per device), or one device: cuda:1 (default: "
                   "machine.device)")  # fmt: skip
    p.add_argument("--kernels", help="the kernel backend to check: auto, torch or triton (default: the recipe's)")
    p.add_argument("--out", metavar="DIR", help="write DIR/selftest.json and DIR/machine.yaml (a machine recipe)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier selftest's --out")
    p.add_argument("--nproc", type=int, help="local processes (default: one per visible GPU, 1 on a CPU)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for `optimus train`")
    return p


def main(argv: list[str]) -> int:
    """`optimus selftest ...`: 0 when every kernel and collective computed correctly, 1 otherwise."""
    from optimus.recipes import load_config

    opts = parser().parse_intermixed_args(argv)
    cfg = load_config(opts.overrides)
    kernels = cfg.kernels if opts.kernels is None else opts.kernels
    if kernels not in BACKENDS:
        raise ConfigError(f"--kernels {kernels} is not a kernel backend: use one of {', '.join(BACKENDS)}.")
    job, nproc = prepare(cfg, opts.device, opts.nproc, kernels)
    return run_command(job, nproc, Path(opts.out) if opts.out else None, opts.overwrite, SELFTEST)


# ---------------------------------------------------------------------------------------------
# Before the work: the recipe, the device, the processes


def check_recipe(cfg: OptimusConfig) -> None:
    """The keys the selftest reads: the model's shape, the dtype, the kernels, the machine; the layout is not
    this node's to check (its world is the job's)."""
    validate_model(cfg.model)
    check_choice(cfg.train.dtype, "train.dtype", ("auto", *TORCH_DTYPES))
    check_choice(cfg.kernels, "kernels", BACKENDS)
    validate_machine_and_data(cfg)
    for key in ("micro_batch", "seq_len"):
        if getattr(cfg.train, key) < 1:
            raise ConfigError(f"train.{key}={getattr(cfg.train, key)} must be at least 1.")
    experts_per_rank(cfg.model.moe.n_experts, cfg.parallel.ep)


def device_count(device_type: str) -> int:
    """Devices of `device_type` torch sees (a CPU counts as one)."""
    if device_type == "cpu":
        return 1
    api = getattr(torch, device_type, None)
    return api.device_count() if api is not None and api.is_available() else 0


def chosen_device(machine: MachineConfig, text: str | None) -> tuple[str, int | None]:
    """(device type, index or None) of --device TYPE[:INDEX], checked against what torch sees; without --device
    the recipe's machine.device."""
    if text is None:
        return declared_device_type(machine), None
    kind, colon, index = text.partition(":")
    if kind not in DEVICE_TYPES or (colon and (kind == "cpu" or not index.isdigit())):
        raise ConfigError(f"--device {text}: name cpu, cuda or xpu, or one device as cuda:INDEX or xpu:INDEX.")
    count = device_count(kind)
    if not count:
        raise ConfigError(f"--device {text}: torch sees no {kind} device here: use --device cpu, or leave it out.")
    if colon and int(index) >= count:
        raise ConfigError(f"--device {text}: this node has {count} {kind} devices, numbered 0 to {count - 1}.")
    return kind, int(index) if colon else None


def local_processes(device_type: str, index: int | None, nproc: int | None) -> int:
    """The processes to start here: --nproc, by default one per device of the type (one where --device names
    one device, and on a CPU)."""
    count = device_count(device_type)
    if nproc is None:
        return 1 if device_type == "cpu" or index is not None else count
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be at least 1.")
    if index is not None and nproc > 1:
        raise ConfigError(
            f"--device {device_type}:{index} names one device: leave out --nproc, or give --device {device_type} "
            "for one process per device."
        )
    if device_type != "cpu" and nproc > count:
        raise ConfigError(f"--nproc {nproc} is more than the {count} {device_type} devices here: one per device.")
    return nproc


def prepare(cfg: OptimusConfig, device: str | None, nproc: int | None, kernels: str | None) -> tuple[Job, int]:
    """The job every rank runs and the local processes to start (0 inside a launcher, which started them); every
    user error refused here, before any work."""
    check_recipe(cfg)
    cfg = copy.deepcopy(cfg)
    device_type, index = chosen_device(cfg.machine, device)
    cfg.machine.device = device_type
    detect_platform(cfg.machine, index or 0)  # refuses a machine.device or machine.backend this node lacks
    if kernels == "triton":  # auto resolves per device, in the ranks; triton must be importable and runnable
        try:
            get_backend(kernels, device_type)
        except KernelUnavailable as err:
            raise ConfigError(str(err)) from None
    info = discover()
    if info.launcher != "none":
        if nproc is not None:
            raise ConfigError(f"the {info.launcher} launcher has started the processes: leave out --nproc.")
        if info.world_size != info.local_world_size:
            raise ConfigError(
                f"the selftest checks one node, and this {info.launcher} job has {info.world_size} processes of "
                f"which {info.local_world_size} are on this node: launch it on one node."
            )
        nproc = 0
    else:
        nproc = local_processes(device_type, index, nproc)
    return Job(cfg, index, kernels, resolve_dtype(cfg.train.dtype, device_type)), nproc


# ---------------------------------------------------------------------------------------------
# The work


def run_command(job: Job, nproc: int, out: Path | None, overwrite: bool, output: Output) -> int:
    """Run `job` on every process, then on rank 0 print the table, write --out and say each failure."""
    info = discover()
    if out is not None and info.rank == 0:
        check_out_dir(out, overwrite, output.marker, output.what, output.files)
    if info.rank == 0:
        processes = nproc or info.world_size
        plural = "es" if processes > 1 else ""
        # On a GPU with kernels=triton most of it is Triton compiling and autotuning each kernel at the recipe's
        # widths and at the awkward ones: over two minutes for mula-7b-a1b's on an H200 (benchmarks/gpu/README.md)
        took = "a few minutes where Triton compiles its kernels" if job.cfg.machine.device != "cpu" else "a minute"
        print(f"{output.command}: {processes} process{plural} on {job.cfg.machine.device}, {took}", flush=True)
    if info.launcher == "none" and nproc > 1:
        try:
            report = spawn_local(nproc, spawned_rank, (job,))[0]
        except SpawnStopped as stopped:  # Ctrl-C or a stop signal, passed on to the processes, which ended
            print(f"optimus: {stopped}.", file=sys.stderr)
            return stopped.exit_code
    else:
        report = selftest_rank(job, info)
    if report is None:  # not rank 0
        return 0
    print(rp.format_table(report, output.command))
    if out is not None:
        texts = {
            "selftest.json": lambda: rp.to_json(report),
            "machine.yaml": lambda: rp.machine_yaml(job.cfg.machine, report, output.command),
            "operators.json": lambda: rp.operators_json(report),
        }
        written = [name for name in output.files if name != "operators.json" or "operators" in report]
        with replacing_directory(out) as tmp:
            for name in written:
                (tmp / name).write_text(texts[name]())
        print(f"wrote {' and '.join(f'{out}/{name}' for name in written)}")
    for sentence in report["failures"]:
        print(f"{output.command}: {sentence}", file=sys.stderr)
    return 1 if report["failures"] else 0


def spawned_rank(job: Job) -> dict | None:
    """Body of a rank that --nproc started: a user error goes to the parent, which says it once."""
    try:
        return selftest_rank(job, discover())
    except ConfigError as err:
        report_user_error(str(err))
        raise SystemExit(2) from None


def selftest_rank(job: Job, info: RankInfo) -> dict | None:
    """This rank's kernels and rates, then (with peers) the collectives; the report on rank 0, None elsewhere."""
    platform = detect_platform(job.cfg.machine, info.local_rank if job.device_index is None else job.device_index)
    if platform.device_type == "cpu":
        share_cpu_threads(info.local_world_size)
    else:
        torch.get_device_module(platform.device_type).set_device(platform.device)
    peers = info.world_size > 1
    if peers:
        init_process_group(info, platform.backend, platform.device, job.cfg.parallel.timeout_s)
    try:
        if peers:
            job = with_operators_of_rank0(job)
        mine = rank_results(job, platform, info.rank)
        if peers:
            dist.barrier()  # every rank's own measurements are done: the links are timed alone
            mine["collectives"] = run_collectives(platform.device, TORCH_DTYPES[job.compute_dtype])
        else:
            mine["collectives"] = {"none": ONE_PROCESS}
        gathered = [mine]
        if peers:
            gathered = [None] * info.world_size if info.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        return rp.build_report(context(job, platform, info.world_size), gathered) if info.rank == 0 else None
    finally:
        if peers and dist.is_initialized():
            dist.destroy_process_group()


def with_operators_of_rank0(job: Job) -> Job:
    """The job with rank 0's operators to time: a calibration under a launcher traces the step on rank 0 only
    (optimus plan --calibrate), so that a node's processes do not each trace it."""
    shared = [(job.signatures, job.step)]
    dist.broadcast_object_list(shared, src=0)
    signatures, step = shared[0]
    return replace(job, signatures=tuple(signatures), step=step)


def rank_results(job: Job, platform: Platform, rank: int) -> dict:
    """The kernels (when asked for) and the rates on this rank's device."""
    cfg, dtype = job.cfg, TORCH_DTYPES[job.compute_dtype]
    kernels = None
    if job.kernels is not None:
        cases = kernel_cases(cfg)
        if cases:
            kernels = {**check_kernels(job.kernels, cases, dtype, platform.device), "none": None}
        else:
            kernels = {"backend": job.kernels, "results": [], "skipped": [], "none": DENSE}
        kernels |= {"setting": job.kernels, "dtype": job.compute_dtype}
    tokens = cfg.train.micro_batch * cfg.train.seq_len
    rates = measure_rates(platform, cfg.machine, cfg.model, tokens, dtype)
    results = {"rank": rank, "device": str(platform.device), "kernels": kernels, "rates": rates}
    if job.signatures:
        if platform.device_type == "cpu":
            keep_cpu_allocations()  # as a training run's rank does
        results["operators"] = time_signatures(list(job.signatures), platform.device)
    return results


def context(job: Job, platform: Platform, processes: int) -> dict:
    """What the results were measured on: date, host, device, versions, recipe."""
    memory = None
    if platform.device_type != "cpu":
        api = torch.get_device_module(platform.device_type)
        memory = api.get_device_properties(platform.device).total_memory
    cfg = job.cfg
    return {
        "date": datetime.date.today().isoformat(),
        "host": socket.gethostname(),
        "device": {
            "type": platform.device_type,
            "name": platform.device_name,
            "processes": processes,
            "backend": platform.backend if processes > 1 else None,
            "memory_bytes": memory,
        },
        "versions": versions(),
        "recipe": {
            "model": cfg.model.name,
            "machine": cfg.machine.name,
            "kernels": job.kernels,
            "compute_dtype": job.compute_dtype,
            "tokens_per_micro_batch": cfg.train.micro_batch * cfg.train.seq_len,
        },
    } | ({"step": job.step, "signatures": len(job.signatures)} if job.signatures else {})


def versions() -> dict:
    """Python, torch and Triton (None where not installed), and the device runtime torch was built with."""
    try:  # the module's own version: ROCm's and XPU's Triton come in packages of other names
        import triton as triton_module

        triton = triton_module.__version__
    except Exception:  # absent, or broken without its driver libraries: as good as absent here
        triton = None
    return {
        "python": python_platform.python_version(),
        "torch": torch.__version__,
        "triton": triton,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "xpu": getattr(torch.version, "xpu", None),
    }
