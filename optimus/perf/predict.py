"""`optimus plan --predict`: the step time of a layout, from dry runs of its real step replayed on a machine model.

The dry run (optimus.dry_run) traces the ranks the replay needs, each a whole step on fake tensors with every
operator and collective recorded (optimus.perf.step_trace): without a pipeline the first rank; with one, the
first rank of the first, second and last pipeline ranks (the second stands for the middle ones). Then:

    no pipeline   the rank's trace replayed on one stream (optimus.perf.replay.Stream): the step
    a pipeline    each traced action (a forward or backward of one micro-batch on one stage) replayed alone; a
                  stage's action costs the sum of its parts (each MoE or dense layer at the mean of the traced
                  layers of its kind, its embedding, its head, the rest), so stages not traced cost what their
                  layers cost; torch's schedule order for every pipeline rank played out across stages
                  (play_schedule); the step adds what comes before the schedule and after it (the optimizer)

Parameter all-gathers that the step leaves in flight for the next forward (optim.overlap_param_gather) are priced
as every step after the first meets them: in the next forward (optimus.perf.carried).

Time split: compute, optimizer (its kernels), exposed communication by kind, pipeline bubble. Its parts add up
to the step time of the rank that ends last. MFU counts the model's FLOPs (optimus.model.flops_per_token, as
`optimus train` reports it) over the step time and the devices' bf16 peak; HFU adds the forward that activation
checkpointing runs again (optimus.parallel.activation_checkpointing.recompute_flops_per_token).
"""

from __future__ import annotations

import copy
import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from optimus.config import ConfigError, OptimusConfig
from optimus.config_checks import layout_of
from optimus.efficiency import strong_efficiency, weak_efficiency
from optimus.model import count_params_of_config, flops_per_token, moe_layer_ids
from optimus.parallel.activation_checkpointing import recompute_flops_per_token
from optimus.parallel.pipeline import rank_stage_indices, stage_layer_ids, stage_sizes
from optimus.perf.buckets import BucketAdvice, advice_line, bucket_advice
from optimus.perf.carried import carried_delay, carried_waits, end_carrying, first_forward, stage_gate
from optimus.perf.costs import collective_time
from optimus.perf.machine import MachineModel, fresh_process_context, machine_model, times_operators, with_timed_ops
from optimus.perf.op_timing import traced_signatures
from optimus.perf.replay import Stream, parse_order, play_schedule, single_stage_order, split_actions
from optimus.perf.step_trace import StepTrace
from optimus.perf.stragglers import straggler_wait


@dataclass
class Prediction:
    machine: str
    world: int
    nodes: float | None
    global_batch: int
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float  # the model's FLOPs (flops_per_token) per second and device
    mfu: float  # model FLOPs utilisation: flops_per_token, 6 N + 12 L D S, over the step and the devices' peak
    # Hardware FLOPs utilisation: the model's FLOPs and the whole forward of what train.activation_checkpointing
    # recomputes (recompute_flops_per_token; Megatron-DeepSpeed's count); = mfu without it.
    hfu: float
    time_split: dict[str, float]  # seconds by part: compute, optimizer, exposed_<kind>, pipeline_bubble
    traced_ranks: list[int] = field(default_factory=list)
    # The machine model it was replayed on; without its operator times (their count is in its sources).
    machine_numbers: dict = field(default_factory=dict)
    # Whether the layout fits the device: `optimus plan`'s peak of the busiest rank against machine.memory_gb
    # (optimus.plan.fit_of; None where the machine does not say). A step that does not fit is printed all the same.
    fits: bool | None = None
    peak_bytes: int = 0
    device_bytes: int | None = None
    # The step replayed with every ranged machine number at its fast end and at its slow end
    # (MachineModel.at_end), as [low, high] with the point between them: without a pipeline, bounds over every
    # machine inside the ranges. None where the machine's numbers carry no ranges (machine=local: measured here).
    step_time_s_range: list[float] | None = None
    tokens_per_s_range: list[float] | None = None
    mfu_range: list[float] | None = None
    hfu_range: list[float] | None = None
    corner_steps: list[float] | None = None  # [the step at the fast corner, at the slow corner]
    # Under ZeRO-2: the gradient buckets' latency share on this machine and the size that would make them
    # bandwidth-bound (optimus.perf.buckets.BucketAdvice); None where the step reduces no gradients in buckets.
    buckets: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def traced_pp_ranks(pp: int) -> list[int]:
    """The pipeline ranks a prediction traces: the first, the second (a middle one) and the last."""
    return sorted({0, min(1, pp - 1), pp - 1})


def _flat_split(split: Counter) -> dict[str, float]:
    """Stream split keys as the prediction names them: compute, optimizer, exposed_<kind>."""
    out = {}
    for key, seconds in split.items():
        out[key if key in ("compute", "optimizer", "pipeline_bubble", "stragglers") else f"exposed_{key}"] = seconds
    return out


def predict_from_traces(
    cfg: OptimusConfig, world: int, machine: MachineModel, traces: dict[int, dict]
) -> tuple[float, Counter]:
    """(step seconds, split) from dry-run results by pipeline rank (each with `events` and `schedule`): the traced
    step replayed, and the wait for the slowest of the world's ranks (optimus.perf.stragglers)."""
    p = cfg.parallel
    if p.pp == 1:
        events = traces[0]["events"]
        stream = Stream(machine, traces[0]["rank"], p.tp).run(events)
        carried = end_carrying(stream, carried_waits(events))
        step, split = stream.t, stream.split
        if carried:  # the steady state: the next step's forward waits for them (optimus.perf.carried)
            delay = carried_delay(machine, traces[0]["rank"], p.tp, first_forward(events), carried)
            step += sum(delay.values())
            split.update(delay)
    else:
        step, split = _pipeline_step(cfg, world, machine, traces)
    wait = straggler_wait(step, machine.rank_variability, world)
    if wait:
        split["stragglers"] += wait
    return step + wait, split


def _place_class(place: str, moe_ids: set[int]) -> str:
    if place.startswith("layers."):
        return "moe" if int(place.split(".")[1]) in moe_ids else "dense"
    return place if place in ("embed", "head") else "other"


@dataclass
class _Part:
    """The cost of one part of a stage's action (a layer of a kind, the embedding, the head), from every traced
    action that has it: seconds by split kind, and async collectives still in flight when the action ends."""

    splits: list[Counter] = field(default_factory=list)
    in_flight: list[float] = field(default_factory=list)

    def add(self, split: Counter, in_flight: float, share: float = 1.0) -> None:
        self.splits.append(Counter({k: v * share for k, v in split.items()}))
        self.in_flight.append(in_flight * share)

    def mean(self) -> tuple[Counter, float]:
        if not self.splits:
            return Counter(), 0.0
        total = Counter()
        for split in self.splits:
            total.update(split)
        n = len(self.splits)
        return Counter({k: v / n for k, v in total.items()}), sum(self.in_flight) / n


def _part_of(place: str, moe_ids: set[int], last_stage: bool) -> str:
    """The part of a stage's action a place belongs to; what runs outside the layers on the last stage is its
    head's loss (the head's matmul and cross-entropy run at the model's root, not in a submodule)."""
    cls = _place_class(place, moe_ids)
    return "other_last" if cls == "other" and last_stage else cls


def _stage_parts(stage: int, n_stages: int, layers_of: list[list[int]], moe_ids: set[int]) -> list[str]:
    """The parts a stage's action is made of: a part per layer (`moe` or `dense`), `embed` on the first stage,
    `head` and `other_last` (its loss) on the last, `other` (what runs outside the model) elsewhere."""
    parts = [_place_class(f"layers.{i}", moe_ids) for i in layers_of[stage]]
    parts += ["embed"] if stage == 0 else []
    return parts + (["head", "other_last"] if stage == n_stages - 1 else ["other"])


def _traced_parts(machine, traces, tp, n_stages, layers_of, moe_ids) -> dict[tuple[str, str], _Part]:
    """Each traced action replayed alone, its time shared out to its parts, by (action type, part)."""
    parts: dict[tuple[str, str], _Part] = defaultdict(_Part)
    for result in traces.values():
        for action in split_actions(result["events"])[1]:
            stream = Stream(machine, result["rank"], tp).run(action.events, skip_p2p=True)
            by_class: dict[str, Counter] = defaultdict(Counter)
            in_flight: Counter = Counter()
            last = action.stage == n_stages - 1
            for (place, kind), seconds in stream.place_split.items():
                by_class[_part_of(place, moe_ids, last)][kind] += seconds
            for place, seconds in stream.in_flight_by_place().items():
                in_flight[_part_of(place, moe_ids, last)] += seconds
            own = Counter(_stage_parts(action.stage, n_stages, layers_of, moe_ids))
            for cls, count in own.items():
                for _ in range(count):  # a layer of a kind: the traced layers' mean
                    parts[(action.type, cls)].add(by_class[cls], in_flight[cls], 1 / count)
    return parts


@dataclass
class _Stages:
    """A pipeline's stages as the replay costs them: each stage's layers, and the mean cost of each part (a layer of a
    kind, the embedding, the head, the rest) of each action type, from the traced actions."""

    n_stages: int
    moe_ids: set[int]
    layers_of: list[list[int]]
    parts: dict[tuple[str, str], _Part]

    @classmethod
    def of(cls, cfg: OptimusConfig, machine: MachineModel, traces: dict[int, dict]) -> _Stages:
        p, m = cfg.parallel, cfg.model
        n_stages = p.pp * p.pp_virtual
        moe_ids = set(moe_layer_ids(m))
        layers_of = stage_layer_ids(stage_sizes(m, n_stages, list(p.pp_layers) if p.pp_layers else None))
        return cls(n_stages, moe_ids, layers_of, _traced_parts(machine, traces, p.tp, n_stages, layers_of, moe_ids))

    def cost(self, kind: str, stage: int) -> tuple[float, float, Counter]:
        """(seconds, seconds of async collectives still in flight at its end, split by kind) of a stage's action."""
        split, in_flight = Counter(), 0.0
        for part in _stage_parts(stage, self.n_stages, self.layers_of, self.moe_ids):
            part_split, part_in_flight = self.parts[(kind, part)].mean()
            split.update(part_split)
            in_flight += part_in_flight
        return sum(split.values()), in_flight, split

    def costs(self) -> dict[tuple[str, int], tuple[float, float, Counter]]:
        """`cost` of every stage's action of each type (F, B, I, W)."""
        return {(kind, s): self.cost(kind, s) for kind in "FBIW" for s in range(self.n_stages)}

    def places(self, stage: int) -> list[str]:
        """The model parts a stage holds, as a trace names them (optimus.perf.step_trace.place_of)."""
        head = ["head"] if stage == self.n_stages - 1 else []
        return (["embed"] if stage == 0 else []) + [f"layers.{i}" for i in self.layers_of[stage]] + head

    def forward_offsets(self, stage: int) -> dict[str, float]:
        """Seconds of a stage's forward before each of its layers starts (the embedding first, then the layers)."""
        elapsed = sum(self.parts[("F", "embed")].mean()[0].values()) if stage == 0 else 0.0
        offsets = {}
        for i in self.layers_of[stage]:
            offsets[f"layers.{i}"] = elapsed
            elapsed += sum(self.parts[("F", _place_class(f"layers.{i}", self.moe_ids))].mean()[0].values())
        return offsets


def stage_costs(cfg: OptimusConfig, machine: MachineModel, traces: dict[int, dict]) -> dict[tuple[str, int], tuple]:
    """Every stage's action of each type (F, B, I, W) as (seconds, seconds of async collectives still in flight
    at its end, split by kind): the sum of its parts' costs from the traced actions."""
    return _Stages.of(cfg, machine, traces).costs()


def _pipeline_step(cfg, world, machine, traces) -> tuple[float, Counter]:
    p = cfg.parallel
    stages = _Stages.of(cfg, machine, traces)
    stage_cost = stages.costs()

    # What runs before the schedule (pipeline rank 0's) and after it (each traced rank's own: the optimizer;
    # a rank not traced has the middle one's), the sends between stages left to `transfer`. What the step after
    # leaves in flight for the next forward (optim.overlap_param_gather) holds each stage's first forward
    # (optimus.perf.carried) and occupies its rank's channel.
    before = Stream(machine, traces[0]["rank"], p.tp).run(split_actions(traces[0]["events"])[0], skip_p2p=True)
    before.drain()
    after, carried = {}, {}
    for pp_rank, result in traces.items():
        after[pp_rank] = Stream(machine, result["rank"], p.tp).run(split_actions(result["events"])[2], skip_p2p=True)
        carried[pp_rank] = end_carrying(after[pp_rank], carried_waits(result["events"]))

    def traced_as(pp_rank: int) -> int:
        return pp_rank if pp_rank in traces else traced_pp_ranks(p.pp)[1]

    gates, channel_busy = {}, {}
    for pp_rank in range(p.pp):
        held = carried[traced_as(pp_rank)]
        if not held:
            continue
        channel_busy[pp_rank] = max(0.0, max(c.left for c in held.values()) - before.t)
        for stage, traced_stage in zip(rank_stage_indices(pp_rank, p.pp, p.pp_virtual),
                                       rank_stage_indices(traced_as(pp_rank), p.pp, p.pp_virtual)):  # fmt: skip
            gates[stage] = stage_gate(held, stages.places(traced_stage), stages.forward_offsets(traced_stage), before.t)

    def after_of(pp_rank: int) -> Stream:
        return after[traced_as(pp_rank)]

    sends = [
        e["call"]["bytes"]
        for r in traces.values()
        for e in r["events"]
        if e["e"] == "comm" and e["call"]["op"] == "send"
    ]
    p2p_bytes = max(sends, default=0)  # a micro-batch's activations (or their gradient) between two stages
    stage_world, offset = layout_of(cfg, world).stage_size, traces[0]["rank"]

    def transfer(a: int, b: int) -> float:
        ra, rb = (a % p.pp) * stage_world + offset, (b % p.pp) * stage_world + offset
        if ra == rb or not p2p_bytes:
            return 0.0
        return collective_time(machine, {"op": "send", "ranks": [ra, rb], "bytes": p2p_bytes}, ra)

    order = schedule_order(cfg, traces)
    played = play_schedule(
        order, stages.n_stages, lambda kind, stage: stage_cost[(kind, stage)][:2], transfer, gates, channel_busy
    )
    critical = max(played.end, key=lambda rank: played.end[rank] + after_of(rank).t)  # the rank that ends last
    split = Counter(before.split)
    for kind, stage, _ in order[critical]:
        split.update(stage_cost[(kind, stage)][2])
    split["pipeline_bubble"] += played.bubble(critical)
    split["data_parallel"] += played.comm_tail[critical] + played.held[critical]
    split.update(after_of(critical).split)
    return before.t + played.end[critical] + after_of(critical).t, split


def schedule_order(cfg: OptimusConfig, traces: dict[int, dict]) -> dict[int, list[tuple[str, int, int]]]:
    """Every pipeline rank's actions in the order its schedule runs them, checked against the traced ranks'."""
    p = cfg.parallel
    first = traces[min(traces)]
    if first["schedule"] is not None:
        order = parse_order(first["schedule"])
    else:
        order = single_stage_order(p.pp_schedule, p.pp, first["layout"]["accum"])
    for pp_rank, result in traces.items():
        ran = [(a.type, a.stage, a.mb) for a in split_actions(result["events"])[1]]
        if ran != order[pp_rank]:
            raise RuntimeError(f"pipeline rank {pp_rank} ran its actions in another order than the replay assumes: "
                               f"{ran[:8]} ... against {order[pp_rank][:8]} ...")  # fmt: skip
    return order


def check_predictable(cfg: OptimusConfig) -> None:
    """What no dry run can trace, refused as a prediction's (optimus.dry_run.check_dry_run_config)."""
    from optimus.dry_run import check_dry_run_config

    check_dry_run_config(cfg, "--predict")


PROGRESS = ("stdout", "stderr", "none")  # where trace_step's child reports each dry run it starts


def trace_step(
    cfg: OptimusConfig,
    world: int,
    imbalance: float = 1.0,
    progress: str = "stdout",
    device: str | None = None,
    signatures: bool | None = None,
) -> dict[int, dict]:
    """Dry runs of the ranks the replay needs, by pipeline rank (optimus.dry_run.dry_run_rank with a StepTrace),
    in a fresh process, which reports each dry run it starts on `progress` (one of PROGRESS), on device path
    `device` (None: the recipe's, optimus.dry_run.dry_run_device), recording each operator's signature with
    `signatures` (None: where the machine prices operators by their measured times). Fresh, because
    torch keeps caches keyed by DeviceMesh (DTensor's sharding decisions) that outlive a process group: a mesh
    of an earlier world over the same ranks would name groups that no longer exist (fresh_process_context)."""
    import tempfile

    check_predictable(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "traces.json"
        signatures = times_operators(cfg.machine) if signatures is None else signatures
        args = (cfg, world, imbalance, str(out), progress, device, signatures)
        child = fresh_process_context().Process(target=_trace_into, args=args)
        child.start()
        child.join()
        result = json.loads(out.read_text()) if out.exists() else {"error": f"exit code {child.exitcode}"}
    if "config_error" in result:
        raise ConfigError(result["config_error"])
    if "error" in result:
        raise RuntimeError(f"the dry runs for the prediction failed: {result['error']}")
    return {int(pp_rank): trace for pp_rank, trace in result["traces"].items()}


def _trace_into(
    cfg: OptimusConfig, world: int, imbalance: float, out: str, progress: str, device: str | None, signatures: bool
) -> None:
    """trace_step's child: the dry runs, their traces (or the error) written to `out` as JSON."""
    import sys
    import traceback

    from optimus.dry_run import dry_run_rank

    stream = {"stdout": sys.stdout, "stderr": sys.stderr}.get(progress)
    try:
        stage_world = layout_of(cfg, world).stage_size
        traces = {}
        for pp_rank in traced_pp_ranks(cfg.parallel.pp):
            rank = pp_rank * stage_world
            if stream is not None:
                print(f"  dry run of rank {rank} of {world} (pipeline rank {pp_rank}) ...", file=stream, flush=True)
            trace = StepTrace(signatures=signatures)
            traces[pp_rank] = dry_run_rank(cfg, world, rank, imbalance, device, step_trace=trace)
        result = {"traces": traces}
    except ConfigError as err:
        result = {"config_error": str(err)}
    except Exception:  # reported by the parent, with the child's traceback
        result = {"error": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))


def prediction_of(cfg: OptimusConfig, world: int, machine: MachineModel, traces: dict[int, dict]) -> Prediction:
    """The step's figures from its traces replayed on `machine` (a local machine times their operators first)."""
    machine = _with_priced_note(with_timed_ops(machine, traces), traces)
    t = cfg.train
    step, split = predict_from_traces(cfg, world, machine, traces)
    tokens = t.global_batch * t.seq_len
    model_flops = flops_per_token(count_params_of_config(cfg.model), cfg.model, t.seq_len) * tokens
    hardware_flops = model_flops + recompute_flops_per_token(cfg.model, t.activation_checkpointing, t.seq_len) * tokens

    def utilisation(seconds: float, flops: float) -> float:
        return flops / seconds / world / machine.peak_flops

    ranges = {}
    if machine.ranges:
        # Without a pipeline the replay is monotone in every number and the two ends bound the step; with one, the
        # stages' costs are composed from per-layer means, which need not be, so the interval spans all three.
        ends = [predict_from_traces(cfg, world, machine.at_end(end), traces)[0] for end in ("fast", "slow")]
        fast, slow = min(*ends, step), max(*ends, step)
        ranges = {
            "step_time_s_range": [fast, slow], "tokens_per_s_range": [tokens / slow, tokens / fast],
            "mfu_range": [utilisation(slow, model_flops), utilisation(fast, model_flops)],
            "hfu_range": [utilisation(slow, hardware_flops), utilisation(fast, hardware_flops)], "corner_steps": ends,
        }  # fmt: skip
    nodes = world / machine.ranks_per_node if machine.ranks_per_node else None
    return Prediction(
        machine=machine.name, world=world, nodes=nodes, global_batch=t.global_batch, step_time_s=step,
        tokens_per_s=tokens / step, tflops_per_device=model_flops / step / world / 1e12,
        mfu=utilisation(step, model_flops), hfu=utilisation(step, hardware_flops),
        time_split=_flat_split(split), traced_ranks=sorted(r["rank"] for r in traces.values()),
        machine_numbers={**asdict(machine), "op_seconds": {}},  # the operator times: thousands of keys
        **planned_fit(cfg, world), **ranges, buckets=_bucket_advice(cfg, machine, traces),
    )  # fmt: skip


def _bucket_advice(cfg: OptimusConfig, machine: MachineModel, traces: dict[int, dict]) -> dict | None:
    from optimus.plan import DTYPE_BYTES, planned_dtype

    if cfg.optim.zero != 2:
        return None
    cap_mb = cfg.optim.max_collective_numel * DTYPE_BYTES[planned_dtype(cfg)] / 2**20  # a bucket's elements' cap
    advice = bucket_advice(cfg.optim.bucket_mb, machine, traces, cap_mb)
    return advice.as_dict() if advice is not None else None


def _with_priced_note(machine: MachineModel, traces: dict[int, dict]) -> MachineModel:
    """The machine with its sources saying how many of this step's distinct operators take a measured time (where
    it has any: machine=local's, a calibration's) and how many the roofline."""
    if not machine.op_seconds:
        return machine
    distinct = traced_signatures(traces)
    timed = sum(sig in machine.op_seconds for sig in distinct)
    note = f"{timed} of the {len(distinct)} distinct operators of this step by their measured times, the rest by "
    note += "the roofline"
    return replace(machine, sources={**machine.sources, "priced": note})


def planned_fit(cfg: OptimusConfig, world: int) -> dict:
    """{fits, peak_bytes, device_bytes} of the layout: `optimus plan`'s peak of its busiest rank against the
    device (the dry runs of a prediction trace the step, not its memory)."""
    from optimus.plan import fit_of, plan_layout
    from optimus.platform import declared_device_path

    plan = plan_layout(cfg, layout_of(cfg, world), declared_device_path(cfg.machine))
    return fit_of(plan.memory["total_configured"], cfg)


def predict(cfg: OptimusConfig, world: int, machine: MachineModel | None = None, imbalance: float = 1.0,
            progress: str = "stdout", device: str | None = None) -> Prediction:  # fmt: skip
    """Trace the ranks the replay needs (dry runs on device path `device`, as optimus plan --dry-run's --device;
    None: the recipe's) and replay them on the machine model."""
    traces = trace_step(cfg, world, imbalance, progress, device)
    return prediction_of(cfg, world, machine or machine_model(cfg.machine, world), traces)


def scaled_batch(cfg: OptimusConfig, world: int, base_world: int) -> OptimusConfig:
    """The recipe with its global batch grown from `base_world` ranks to `world` (weak scaling: the same batch
    per rank)."""
    if cfg.train.global_batch * world % base_world:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} x {world} / {base_world} ranks is not a whole batch for "
            "weak scaling: pick node counts that are multiples of the first."
        )
    scaled = copy.deepcopy(cfg)
    scaled.train.global_batch = cfg.train.global_batch * world // base_world
    return scaled


def scaling_points(cfg: OptimusConfig, worlds: list[int]) -> list[dict]:
    """Per world size, the configs `scaling` predicts, each validated: `strong` (the recipe, or None with
    `strong_refused` where its layout does not divide the batch) and `weak` (the batch grown from the first world
    size). A first world size that does not run, or a weak point that does not, is refused here."""
    from optimus.config_checks import validate

    validate(copy.deepcopy(cfg), worlds[0])
    points = []
    for world in worlds:
        point = {"world": world, "strong": cfg, "weak": cfg}
        try:
            validate(copy.deepcopy(cfg), world)  # a layout that does not divide the batch is refused here
        except ConfigError as refused:
            point["strong"], point["strong_refused"] = None, str(refused)
        if world != worlds[0]:
            point["weak"] = scaled_batch(cfg, world, worlds[0])
            validate(copy.deepcopy(point["weak"]), world)
        points.append(point)
    return points


def scaling(
    cfg: OptimusConfig,
    worlds: list[int],
    machine_for,
    imbalance: float = 1.0,
    progress: str = "stdout",
    device: str | None = None,
) -> list[dict]:
    """Per world size: the strong-scaling prediction (the recipe's global batch) and the weak-scaling one (the
    batch grown with the world from the first), with their efficiencies against the first world size
    (optimus.efficiency). A strong-scaling point whose layout does not divide the batch is left out (`strong`
    None, and `strong_refused` says why); the first world size, every efficiency's base, must run."""
    import sys

    stream = {"stdout": sys.stdout, "stderr": sys.stderr}.get(progress)

    def say(line: str) -> None:
        if stream is not None:
            print(line, file=stream, flush=True)

    rows = []
    for point in scaling_points(cfg, worlds):  # every layout checked before the first prediction
        world, row = point["world"], {"world": point["world"], "strong": None}
        if point["strong"] is None:
            row["strong_refused"] = point["strong_refused"]
            say(f"{world} ranks: no strong-scaling point: {point['strong_refused']}")
        else:
            say(f"{world} ranks, strong scaling (global batch {cfg.train.global_batch}):")
            row["strong"] = predict(cfg, world, machine_for(world), imbalance, progress, device)
        if world == worlds[0]:
            row["weak"] = row["strong"]
        else:
            weak_cfg = point["weak"]
            say(f"{world} ranks, weak scaling (global batch {weak_cfg.train.global_batch}):")
            row["weak"] = predict(weak_cfg, world, machine_for(world), imbalance, progress, device)
        rows.append(row)
    base = rows[0]["strong"]
    for row in rows:
        strong, weak = row["strong"], row["weak"]
        row["strong_efficiency"], row["strong_efficiency_range"] = (
            efficiencies("strong", base, strong) if strong else (None, None)
        )
        row["weak_efficiency"], row["weak_efficiency_range"] = efficiencies("weak", base, weak)
    return rows


def efficiencies(kind: str, base: Prediction, pred: Prediction) -> tuple[float, list[float] | None]:
    """The `strong` or `weak` scaling efficiency of `pred` against `base` (optimus.efficiency), and its range: the
    lower and higher of its values with one machine at both sizes, at the fast corner of its ranges, at the slow
    one and at the recipe's numbers (None without ranges). Not a bound: a machine inside the ranges with a fast
    device and a slow network scales worse than either corner."""

    def efficiency(base_step: float, step: float) -> float:
        if kind == "strong":
            return strong_efficiency(base_step, base.world, step, pred.world)
        base_tokens, tokens = (p.tokens_per_s * p.step_time_s for p in (base, pred))
        return weak_efficiency(base_tokens / base_step / base.world, tokens / step / pred.world)

    point = efficiency(base.step_time_s, pred.step_time_s)
    if base.corner_steps is None or pred.corner_steps is None:
        return point, None
    values = [point, *(efficiency(b, p) for b, p in zip(base.corner_steps, pred.corner_steps))]
    return point, [min(values), max(values)]


def fit_lines(layouts: list[tuple[OptimusConfig, int]]) -> list[str]:
    """The lines that come first, before any work, for each (config, world) to predict whose layout does not fit
    its device (optimus.plan's rule, on its peak of the busiest rank)."""
    from optimus.plan import does_not_fit_line

    lines = []
    for cfg, world in layouts:
        fit = planned_fit(cfg, world)
        if fit["fits"] is False:
            whose = f"world {world}, global batch {cfg.train.global_batch}: optimus plan puts the busiest rank at"
            lines.append(does_not_fit_line(fit, whose))
    return lines


def format_prediction(pred: Prediction) -> list[str]:
    where = f"{pred.nodes:g} nodes, " if pred.nodes else ""
    lines = [
        f"predicted step on {pred.machine} ({where}{pred.world} ranks, global batch {pred.global_batch}): "
        f"{pred.step_time_s:.3f} s, {pred.tokens_per_s:,.0f} tokens/s, {pred.tflops_per_device:.1f} TFLOPS per "
        f"device, MFU {100 * pred.mfu:.1f}%",
        f"  {utilisation_line(pred.mfu, pred.hfu)}",
        "  time split: " + ", ".join(f"{k} {v:.3f} s ({100 * v / pred.step_time_s:.0f}%)"
                                     for k, v in sorted(pred.time_split.items(), key=lambda kv: -kv[1]) if v > 0),
    ]  # fmt: skip
    sources = pred.machine_numbers.get("sources", {})
    if "priced" in sources:
        lines.append(f"  operators priced: {sources['priced']} ({sources['operators']})")
    if pred.buckets is not None:
        lines.append(f"  {advice_line(BucketAdvice(**pred.buckets))}")
    if pred.step_time_s_range is None:
        lines.append(f"  interval: none (machine={pred.machine}'s numbers carry no ranges: machine.perf.ranges)")
        return lines
    (fast, slow), (few, many) = pred.step_time_s_range, pred.tokens_per_s_range
    (low, high), (hw_low, hw_high) = pred.mfu_range, pred.hfu_range
    lines.append(
        f"  interval, low - likely - high (machine.perf.ranges at both ends, and the point): step {fast:.3f} - "
        f"{pred.step_time_s:.3f} - {slow:.3f} s, {few:,.0f} - {pred.tokens_per_s:,.0f} - {many:,.0f} tokens/s, "
        f"MFU {100 * low:.1f} - {100 * pred.mfu:.1f} - {100 * high:.1f}%"
        + (f", HFU {100 * hw_low:.1f} - {100 * pred.hfu:.1f} - {100 * hw_high:.1f}%" if pred.hfu != pred.mfu else "")
    )
    return lines


def utilisation_line(mfu: float, hfu: float) -> str:
    """The two conventions, named: MFU counts the model's FLOPs; HFU adds the whole forward of every module that
    activation checkpointing recomputes, as Megatron-DeepSpeed's logged TFLOPS do (torch's early stop may skip
    a module's last product, so the hardware can run a little less)."""
    model = f"MFU {100 * mfu:.1f}% counts the model's FLOPs (6 N + 12 L D S per token)"
    if hfu == mfu:
        return f"{model}; HFU, which adds the recomputed forward, is the same: nothing is recomputed"
    return (
        f"{model}; HFU {100 * hfu:.1f}% adds the forward that activation checkpointing runs again "
        "(Megatron-DeepSpeed's count)"
    )


def _percent(value: float, bounds: list[float] | None) -> str:
    """A fraction as a percentage, with its range where it has one: 92.1% (88.0-95.3)."""
    return f"{100 * value:.1f}%" + (f" ({100 * bounds[0]:.1f}-{100 * bounds[1]:.1f})" if bounds else "")


def format_scaling(rows: list[dict]) -> list[str]:
    lines = [
        "ranks | strong: step s, tokens/s, MFU, efficiency (over both corners and the point) | weak: batch, step s, "
        "MFU, efficiency (over both corners and the point)"
    ]
    for row in rows:
        s, w = row["strong"], row["weak"]
        strong = (
            f"{s.step_time_s:.3f}, {s.tokens_per_s:,.0f}, {100 * s.mfu:.1f}%, "
            f"{_percent(row['strong_efficiency'], row['strong_efficiency_range'])}"
            if s
            else "(the batch does not divide)"
        )
        lines.append(
            f"{row['world']:>5} | {strong} | {w.global_batch}, {w.step_time_s:.3f}, {100 * w.mfu:.1f}%, "
            f"{_percent(row['weak_efficiency'], row['weak_efficiency_range'])}"
        )
    return lines


def scaling_json(rows: list[dict]) -> dict:
    first = rows[0]["strong"]
    return {
        **first.as_dict(),
        "scaling": [
            {"world": r["world"], "nodes": r["weak"].nodes, "strong": r["strong"] and r["strong"].as_dict(),
             "weak": r["weak"].as_dict(), "strong_efficiency": r["strong_efficiency"],
             "strong_efficiency_range": r["strong_efficiency_range"], "weak_efficiency": r["weak_efficiency"],
             "weak_efficiency_range": r["weak_efficiency_range"]}
            for r in rows
        ],
    }  # fmt: skip
