"""`optimus plan --dry-run`: one training step of a layout at its real world size, on fake tensors.

For each requested rank, in this process, one after the other:

    a fake process group   init_process_group("fake", world_size=W, rank=R): every collective completes at
                           once with outputs of the right shape, so rank R builds every group the real run
                           builds and issues every call it would, without the other W - 1 ranks
    fake tensors           FakeTensorMode: every op runs on shapes, dtypes and devices alone, on the device path
                           traced (dry_run_device: the recipe's machine.device or --device): the CPU's, or a
                           GPU's on the stand-in device of optimus.fake_device, on any machine
    the real step          optimus.train.step.TrainStep, as a run's trainer builds it: the model build (meta,
                           then this rank's shard), its parallelisation, activation checkpointing, dispatcher,
                           pipeline schedule, loss, backward and the sharded optimizer's step, run on fake
                           micro-batches of the real shape
    a load model           fake tensors hold no routing: the rows the expert exchange moves come from
                           optimus.load_model (uniform, or --imbalance X for the busiest expert); every other
                           value read back reads as zero (finite, no stop), and each read is counted

and four recorders: torch's MemTracker (peak bytes by category, beside `optimus plan`'s prediction for the
rank), the collective trace (optimus.parallel.collective_trace, the same recorder as profile.collectives=true
in a real run), the host synchronisations (optimus.host_syncs) and the operators (optimus.operators).
Each rank's result is a JSON file: `rank`, `world`, `layout`, `device` (the path), `kernels`, `memory`
{peak_bytes, planned_bytes, by_category}, `collectives`, `host_syncs`, `operators`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from optimus.config import ConfigError, OptimusConfig
from optimus.fake_device import engine_error_explained
from optimus.host_syncs import HostSyncCounter
from optimus.kernels import torch_private as tp
from optimus.layout import Layout
from optimus.load_model import ExpertLoad, LoadAnswers
from optimus.operators import OperatorCounter
from optimus.output_dir import check_out_dir, replacing_directory
from optimus.parallel.collective_trace import CollectiveTrace
from optimus.platform import DEVICE_PATHS, Platform, declared_device_path, detect_platform, stand_in_platform
from optimus.run_spec import resolve_run
from optimus.stop_signals import stops_end_the_process
from optimus.train import step_memory
from optimus.train.step import TrainStep, parallel_state_of
from optimus.train.step_memory import step_memory_tracker

DEVICES = DEVICE_PATHS  # what --device takes: cpu, or the stand-in of a GPU's (cuda, rocm, xpu)


@dataclass
class FakeBatches:
    """A step's micro-batches of token ids, [micro_batch, seq_len + 1] each, made under the fake mode on `device`."""

    n_micro_batches: int
    micro_batch: int
    seq_len: int
    vocab_size: int
    device: torch.device

    def next_step(self) -> list[torch.Tensor]:
        shape = (self.micro_batch, self.seq_len + 1)
        return [torch.randint(0, self.vocab_size, shape, device=self.device) for _ in range(self.n_micro_batches)]


def dry_run_device(cfg: OptimusConfig, device: str | None) -> str:
    """The device path a dry run traces: --device, or the recipe's own machine.device (for `auto`, this machine's)."""
    path = declared_device_path(cfg.machine) if device is None else device
    if path not in DEVICES:
        raise ConfigError(f"--device {path} is not supported: use one of {', '.join(DEVICES)}.")
    return path


def dry_run_platform(cfg: OptimusConfig, device: str | None) -> Platform:
    """The platform the step is traced for: this machine's CPU, or the stand-in of a GPU (optimus.fake_device)."""
    path = dry_run_device(cfg, device)
    if path == "cpu":
        machine = copy.copy(cfg.machine)
        machine.device, machine.backend = "cpu", None
        return detect_platform(machine, 0)
    return stand_in_platform(path)


def answer_read(tensor: torch.Tensor) -> bool | float | int:
    """The value a dry run gives a read of a fake tensor the load model does not cover. Zero (False), which
    the step reads as "finite, nothing skipped, no stop requested" - except for torch's pipeline schedules'
    start-up vote (1: every stage gave its input and output shapes, as Optimus's stages do, so the schedule
    takes them as given instead of inferring them from a trial forward)."""
    if any(frame.name == "_warmup_p2p" for frame in traceback.extract_stack()):
        return 1
    if tensor.dtype == torch.bool:
        return False
    return 0.0 if tensor.dtype.is_floating_point else 0


def check_dry_run_config(cfg: OptimusConfig, what: str = "A dry run") -> None:
    """What no dry run can trace (`what`: the command that needs one, as its refusal names it)."""
    if cfg.model.moe.capacity_factor is not None:
        raise ConfigError(
            f"{what} traces dropless routing only (which tokens a capacity limit drops depends on values): "
            "set model.moe.capacity_factor=null."
        )


@contextlib.contextmanager
def known_warnings_quiet() -> Iterator[None]:
    """Silence, while a dry run runs, the warning that every one of them raises and that says nothing about the
    layout: MemTracker meets a None among a module's outputs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass of tensor", UserWarning)
        yield


@contextlib.contextmanager
def sharding_metadata_apart() -> Iterator[None]:
    """DTensor's output-shape propagation apart from the step's fake mode and recorders, as in a real run.

    To learn an operator's output shape, DTensor runs it on tensors of the global shapes in the fake mode it
    finds active, or in a new one. A real run has none active, so those tensors allocate nothing and no
    recorder sees them. A dry run has one, and its recorders saw them: MemTracker counted, for instance,
    the whole [ffn, D] w2 of a tensor-parallel layer as a temporary, 3.3 GiB at the peak of frontier-1t's
    stage. Here the propagation runs out of the step's modes, in a fresh fake mode, as it does in a real run.
    Where this torch moved the method, nothing changes and the dry run keeps counting them (torch_private)."""
    if not all(tp.found(name) for name in ("sharding_metadata", "dispatch_modes", "FakeTensorMode")):
        yield
        return
    propagator = tp.ShardingPropagator
    traced = propagator._propagate_tensor_meta_non_cached

    def apart(self, op_schema):
        with tp.disable_current_modes(), tp.FakeTensorMode(allow_non_fake_inputs=True):
            return traced(self, op_schema)

    propagator._propagate_tensor_meta_non_cached = apart
    try:
        yield
    finally:
        propagator._propagate_tensor_meta_non_cached = traced


def check_rank(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is not a rank of a world of {world}: pick one in 0..{world - 1}.")


def dry_run_rank(
    cfg: OptimusConfig, world: int, rank: int, imbalance: float = 1.0, device: str | None = None, step_trace=None
) -> dict:
    """One training step of `rank` of `world` ranks on fake tensors, on device path `device` (None: the recipe's
    machine.device, dry_run_device): its memory, collectives, host syncs and operators.
    With `step_trace` (an optimus.perf.step_trace.StepTrace: the collective trace that also records every
    operator and marks the pipeline's actions), the step's events under `events` and the schedule's order
    under `schedule`, instead of the memory (torch's MemTracker, which the performance model does not need)."""
    from optimus.kernels.torch_private import FakeStore, set_custom_default_backend
    from optimus.plan import fit_of, plan_run

    check_dry_run_config(cfg)
    check_rank(rank, world)
    cfg = copy.deepcopy(cfg)
    cfg.parallel.check_collectives = False  # a fake group has no values to check
    cfg.check_kernels = False  # nor have fake tensors
    cfg.parallel.nproc = world
    spec = resolve_run(cfg, world, dry_run_platform(cfg, device))
    started = time.perf_counter()
    # The fake group serves the CPU, and the stand-in device where the step runs on one (its point-to-point
    # batches ask the group for a backend of their tensors' device type).
    backend = "fake" if not spec.platform.traced else f"cpu:fake,{spec.platform.device_type}:fake"
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world)
    if spec.platform.traced:
        set_custom_default_backend(dist.group.WORLD)  # else ending the group logs torch's "No backend of type 0"
    try:
        # In the step's dispatch modes a stop signal ends the process at once: an exception could not unwind them.
        with stops_end_the_process(), known_warnings_quiet(), engine_error_explained(), sharding_metadata_apart():
            step, recorders = _step(spec, imbalance, step_trace)
        ps = step.ps
    finally:
        dist.destroy_process_group()
    plan = plan_run(spec)
    planned = plan.stages[ps.pp_rank]["total_bytes"] if plan.stages else plan.memory["total_configured"]
    measured = None if recorders.memory is None else step_memory.record(recorders.memory)
    result = {
        "rank": rank,
        "world": world,
        "layout": {
            "pp": ps.pp,
            "dp": ps.dp,
            "tp": ps.tp,
            "ep": ps.ep,
            "edp": ps.edp,
            "pp_rank": ps.pp_rank,
            "tp_rank": ps.tp_rank,
            "ep_rank": ps.ep_rank,
            "accum": step.accum,
        },
        "device": spec.platform.path,
        "kernels": step.kernels.name,
        "imbalance": imbalance,
        "memory": None
        if measured is None
        else {
            **measured,
            "planned_bytes": planned,
            "optimizer_state": step.optimizer.memory_bytes(),
            **fit_of(measured["peak_bytes"], cfg),  # the measured peak against the device (fits, device_bytes)
        },
        "collectives": recorders.collectives.calls,
        "host_syncs": recorders.host_syncs.as_list(),
        "operators": recorders.operators.summary(),
        "seconds": time.perf_counter() - started,
    }
    if step_trace is not None:
        result["events"] = step_trace.finish()
        result["schedule"] = pipeline_order(step)
    return result


@dataclass
class StepRecorders:
    """What watched a dry run's step: its memory (torch's MemTracker; None with a step trace), operators,
    collectives (a CollectiveTrace, or the StepTrace that also records operators) and host syncs."""

    memory: object | None
    operators: OperatorCounter
    collectives: CollectiveTrace
    host_syncs: HostSyncCounter


def _step(spec, imbalance: float, step_trace) -> tuple[TrainStep, StepRecorders]:
    """One step of the run `spec` on fake tensors, in the fake process group dry_run_rank made: the step as
    the trainer builds it, and what recorded it."""
    from optimus.kernels.torch_private import FakeTensorMode

    cfg, t = spec.cfg, spec.cfg.train
    fake, load = FakeTensorMode(allow_non_fake_inputs=True), ExpertLoad(cfg.model.moe.n_experts, imbalance)
    ps = parallel_state_of(spec)  # outside the fake mode: a DeviceMesh reads its ranks back
    step = TrainStep(spec, ps, tensor_mode=fake, answers=LoadAnswers(load, ps.ep_rank))
    batches = FakeBatches(step.accum, t.micro_batch, t.seq_len, cfg.model.vocab_size, step.device)
    gc.collect()  # an earlier rank's garbage, freed during this one's step, would change what it measures
    with fake:
        recorders = StepRecorders(
            memory=None if step_trace is not None else step_memory_tracker(step.model, step.optimizer),
            operators=OperatorCounter(),
            collectives=step_trace if step_trace is not None else CollectiveTrace(),
            host_syncs=HostSyncCounter(answer_reads=answer_read),
        )
        with ExitStack() as stack:
            for recorder in (recorders.memory, recorders.operators, recorders.collectives, recorders.host_syncs):
                if recorder is not None:  # (innermost last)
                    stack.enter_context(recorder)
            if step_trace is not None and step.pipeline is not None:
                stack.enter_context(step_trace.mark_actions(step.pipeline.pipeline_stages))
            with step.timers("data_wait"):
                micro_batches = batches.next_step()
            step.run(micro_batches, 0, lambda: False, recorders.collectives)
            if step_trace is not None and cfg.optim.overlap_param_gather:  # left in flight for the next forward
                step_trace.carry_to_next_forward(step.model.named_parameters())
    return step, recorders


def pipeline_order(step) -> dict[int, list[str]] | None:
    """Every pipeline rank's actions in the order an interleaved schedule runs them (torch's pipeline_order,
    which those schedules execute, as "F2_5"-style strings: type, stage, micro-batch); None otherwise (GPipe's
    and 1F1B's pipeline_order is a drawing, not what they run: optimus.perf.replay.single_stage_order)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    schedule = step.pipeline.schedule if step.pipeline is not None else None
    if not isinstance(schedule, PipelineScheduleMulti):
        return None
    return {
        int(rank): [f"{a.computation_type.value}{a.stage_index}_{a.microbatch_index}" for a in actions if a is not None]
        for rank, actions in schedule.pipeline_order.items()
    }


def busiest_rank(plan, layout: Layout) -> int:
    """The rank that `plan` (optimus plan's, of this layout) predicts needs the most memory: the first of its
    busiest pipeline rank's stage, which holds the first experts (the busiest under --imbalance) and the first
    tensor-parallel slice."""
    pp_rank = max(plan.stages, key=lambda row: row["total_bytes"])["pp_rank"] if plan.stages else 0
    return pp_rank * layout.stage_size


def group_check_ranks(layout: Layout) -> list[int]:
    """Ranks whose traces cover every member of one group of each kind - rank 0's TP, EP, expert-data-parallel,
    data-parallel and pipeline groups - and every role (each pipeline stage, tp rank and ep rank; the last rank
    of the world)."""
    kinds = (layout.tp_groups, layout.ep_groups, layout.edp_groups, layout.dp_groups, layout.pp_groups)
    return sorted({rank for groups in kinds for rank in groups()[0]} | {layout.world - 1})


def summary_lines(result: dict) -> list[str]:
    """A rank's dry run in a few lines: whether its peak fits the device (first, where it does not), memory,
    collectives by kind, host syncs, time."""
    from optimus.plan import does_not_fit_line

    mib = 2**20
    mem = result["memory"]
    ratio = mem["peak_bytes"] / mem["planned_bytes"] if mem["planned_bytes"] else float("nan")
    by_kind: dict[str, list[int]] = {}
    for call in result["collectives"]:
        count_bytes = by_kind.setdefault(call["op"], [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += call["bytes"]
    kinds = ", ".join(f"{op} {n} ({b / mib:.1f} MiB)" for op, (n, b) in sorted(by_kind.items()))
    categories = ", ".join(f"{k} {v / mib:.1f}" for k, v in mem["by_category"].items() if v)
    syncs = sum(s["count"] for s in result["host_syncs"])
    lay, ops = result["layout"], result["operators"]
    verdict = [does_not_fit_line(mem, f"rank {result['rank']} measured a peak of")] if mem["fits"] is False else []
    return verdict + [
        f"rank {result['rank']} of {result['world']} (pp_rank {lay['pp_rank']}, tp_rank {lay['tp_rank']}, "
        f"ep_rank {lay['ep_rank']}; {lay['accum']} micro-batches) on the {result['device']} path "
        f"(kernels={result['kernels']}), on fake tensors: {result['seconds']:.1f} s",
        f"  memory: peak {mem['peak_bytes'] / mib:.1f} MiB measured, {mem['planned_bytes'] / mib:.1f} MiB planned "
        f"(measured / planned {ratio:.3f}); at the peak, MiB: {categories}",
        f"  collectives: {len(result['collectives'])} calls: {kinds}",
        f"  host syncs: {syncs}: " + "; ".join(f"{s['where']} x{s['count']}" for s in result["host_syncs"]),
        f"  operators: {len(ops)} kinds, {sum(o['calls'] for o in ops.values())} calls; most bytes: "
        + ", ".join(f"{name} x{o['calls']} ({o['bytes'] / mib:.0f} MiB)" for name, o in list(ops.items())[:4]),
    ]


def run_dry_runs(cfg: OptimusConfig, world: int, ranks: list[int], imbalance: float, device: str) -> dict:
    """Every rank's result, by rank; each rank's lines are printed as it ends."""
    results = {}
    for rank in ranks:
        results[rank] = dry_run_rank(cfg, world, rank, imbalance, device)
        print("\n".join(summary_lines(results[rank])), flush=True)
    return results


SUMMARY = "dry_run.json"  # beside the ranks' files: what was run, and the group check's verdict


RANK_FILES = "rank[0-9]*.json"  # DIR/rank<R>.json


def check_out(out: Path, overwrite: bool) -> None:
    check_out_dir(out, overwrite, SUMMARY, "a dry run's output", (RANK_FILES, SUMMARY))


def write_results(results: dict, summary: dict, out: Path) -> None:
    """DIR/rank<R>.json per rank and DIR/dry_run.json, written into a new directory that replaces `out` when
    complete (check_out first)."""
    with replacing_directory(out) as tmp:
        for rank, result in results.items():
            (tmp / f"rank{rank}.json").write_text(json.dumps(result, indent=1) + "\n")
        (tmp / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
