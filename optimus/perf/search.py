"""`optimus plan --search`: a recipe's layouts at one world size, ranked by predicted step time.

A layout is a value for each axis below (the keys it sets); a key that the command line sets is fixed, and
an axis then takes only the values that keep it (parallel.pp=1 fixed: the pipeline axis's 1F1B). Three passes:

    fit       every structural layout (pipeline and schedule, tp, ep, micro-batch) with the recipe's other keys,
              checked as `optimus train` checks a config (a layout that does not divide is not a layout) and planned
              (optimus.plan): each takes the least activation checkpointing whose planned peak fits the device
              (recomputation only adds work to a step, so a lighter mode that fits is never slower), or is dropped
              with its peak and the limit
    descent   from the recipe's layout (or, where it does not fit, the fitting structure with the fewest pipeline
              stages), every axis in turn: each of its other values predicted (optimus.perf.predict, on the
              recipe's device path) with the rest held, the fastest kept; rounds until no axis improves the step.
              Layouts already predicted are not traced again, and `jobs` predictions run at once
    verify    the fastest layouts' busiest ranks run as dry runs (optimus.dry_run) until `verify` of them fit:
              their measured peak against the device; one that does not fit is dropped from the ranking (the
              planner's peak is an estimate, a few percent off), and the next one verified

The descent is a local search: it predicts the layouts on its path (tens), not the thousands the axes span;
each axis is tried from the best layout found so far, so what two axes gain together is found when each gains
alone. Every layout it predicts is in the result, ranked.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from optimus.config import ConfigError, OptimusConfig
from optimus.config_checks import layout_of, validate
from optimus.model import count_params_of_config
from optimus.perf.buckets import BucketAdvice, advice_line
from optimus.perf.machine import MachineModel

MICRO_BATCH = "train.micro_batch"
# The keys a layout sets, axis by axis, in the order the descent tries them. Values are generated from the layout
# the axis starts from (optimus.perf.search.axis_values); a generated layout that does not divide is tried with the
# nearest micro-batch that makes it divide (Search._dividing), else skipped.
AXES = {
    "pipeline": ("parallel.pp", "parallel.pp_schedule", "parallel.pp_virtual"),
    "tp": ("parallel.tp",),
    "ep": ("parallel.ep",),
    "micro_batch": (MICRO_BATCH,),
    "sharding": ("optim.sharding",),
    "zero": ("optim.zero",),
    "shard_ranks": ("optim.shard_ranks",),
    "param_gather": ("optim.overlap_param_gather",),
    "bucket": ("optim.bucket_mb",),
    "dispatch": ("parallel.dispatcher", "parallel.ep_overlap_chunks"),
}
AXIS_KEYS = tuple(key for keys in AXES.values() for key in keys)
STRUCTURE = ("pipeline", "tp", "ep", "micro_batch")  # what the fit pass enumerates
CHECKPOINTING = "train.activation_checkpointing"  # not an axis: the least that fits (or the command line's)
SEARCH_KEYS = (*AXIS_KEYS, CHECKPOINTING)

# Schedules the search tries with more than one stage: 1F1B, and interleaved 1F1B and zero bubble with two stages
# per rank. GPipe runs the same bubble as 1F1B with every micro-batch's activations held.
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2))
BUCKET_MB = (32.0, 128.0, 512.0)
# Tensor parallelism of powers of two up to 8: wider splits a head's matrices below what these GPUs run well (fix
# parallel.tp on the command line to try another)
MAX_TP = 8


Values = dict[str, object]  # dotted key -> value


def values_of(cfg: OptimusConfig, keys=SEARCH_KEYS) -> Values:
    """The config's value of each key."""
    return {key: _get(cfg, key) for key in keys}


def _get(cfg: OptimusConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def with_values(cfg: OptimusConfig, values: Values) -> OptimusConfig:
    """A copy of `cfg` with `values` set; a pipeline other than the recipe's takes the automatic layer split."""
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        *path, name = key.split(".")
        node = out
        for part in path:
            node = getattr(node, part)
        setattr(node, name, value)
    p = out.parallel
    if (p.pp, p.pp_virtual) != (cfg.parallel.pp, cfg.parallel.pp_virtual):
        p.pp_layers = None
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def axis_values(axis: str, cfg: OptimusConfig, world: int) -> list[Values]:
    """The values the search tries for `axis` from the layout `cfg` (some may not divide: they are skipped)."""
    m, p, rpn = cfg.model, cfg.parallel, cfg.machine.ranks_per_node or world
    moe = m.moe.n_experts > 0
    if axis == "pipeline":
        stages = [pp for pp in _powers_of_two(min(world, m.n_layers)) if world % pp == 0]
        out = [{"parallel.pp": 1, "parallel.pp_schedule": "1f1b", "parallel.pp_virtual": 1}]
        for pp in stages[1:]:
            out += [{"parallel.pp": pp, "parallel.pp_schedule": s, "parallel.pp_virtual": v} for s, v in SCHEDULES]
        return out
    if axis == "tp":
        return [{"parallel.tp": tp} for tp in _powers_of_two(MAX_TP) if rpn % tp == 0]
    if axis == "ep":
        return [{"parallel.ep": ep} for ep in _divisors(rpn) if moe and m.moe.n_experts % ep == 0] or [
            {"parallel.ep": 1}
        ]
    if axis == "micro_batch":
        return [{MICRO_BATCH: mb} for mb in _powers_of_two(8)]
    if axis == "sharding":
        return [{"optim.sharding": s} for s in (("ep_aware", "standard") if moe else ("standard",))]
    if axis == "zero":
        return [{"optim.zero": z} for z in (1, 2)]
    if axis == "shard_ranks":
        return [{"optim.shard_ranks": s} for s in _shard_groups(cfg, world)]
    if axis == "param_gather":
        return [{"optim.overlap_param_gather": flag} for flag in (False, True)]
    if axis == "bucket":  # ZeRO-1 reduces and gathers in step(), not in buckets, unless the gathers overlap
        bucketed = cfg.optim.zero == 2 or cfg.optim.overlap_param_gather  # (optim.memory.zero_bucket_bytes)
        return [{"optim.bucket_mb": mb} for mb in (BUCKET_MB if bucketed else (cfg.optim.bucket_mb,))]
    if axis == "dispatch":
        if not moe or p.ep == 1:
            return [{"parallel.dispatcher": p.dispatcher, "parallel.ep_overlap_chunks": p.ep_overlap_chunks}]
        return [
            {"parallel.dispatcher": "alltoall", "parallel.ep_overlap_chunks": 1},
            {"parallel.dispatcher": "alltoall", "parallel.ep_overlap_chunks": 2},
            {"parallel.dispatcher": "allgather", "parallel.ep_overlap_chunks": 1},
        ]
    raise ValueError(f"no axis {axis!r}")


def _powers_of_two(top: int) -> list[int]:
    return [2**i for i in range(int(math.log2(top)) + 1)] if top >= 1 else []


def _shard_groups(cfg: OptimusConfig, world: int) -> list[int | None]:
    """All of a group's ranks (null), and groups of a node's data-parallel ranks times powers of two below that."""
    try:
        layout = layout_of(with_values(cfg, {"optim.shard_ranks": None}), world)
    except ConfigError:
        return [None]
    both = math.gcd(layout.dp, layout.edp)
    per_node = max(1, (cfg.machine.ranks_per_node or world) // layout.tp)
    sizes = [per_node * 2**k for k in range(12) if per_node * 2**k < both and both % (per_node * 2**k) == 0]
    return [None, *sizes]


@dataclass
class Visit:
    """One layout the search looked at: its values (the axes' keys and the checkpointing it takes), and what became
    of it: invalid (why), dropped (planned peak over the device, or its busiest rank's dry run's), or predicted."""

    values: Values
    status: str  # invalid | dropped | fits | predicted | failed (dropped after its prediction: its dry run's peak)
    reason: str = ""
    peak_bytes: int | None = None
    device_bytes: int | None = None
    prediction: dict | None = None  # optimus.perf.predict.Prediction.as_dict()
    verified: dict | None = None  # the busiest rank's dry run: {rank, peak_bytes, fits}

    @property
    def step(self) -> float:
        return self.prediction["step_time_s"] if self.prediction else math.inf

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SearchResult:
    world: int
    nodes: float | None
    machine: str
    structures: int  # structural layouts enumerated
    visits: list[Visit] = field(default_factory=list)
    seconds: float = 0.0

    recipe: Values = field(default_factory=dict)  # the recipe's values of the search's keys

    def ranked(self) -> list[Visit]:
        """Predicted layouts, fastest first; of equal steps, the one that changes fewer of the recipe's keys."""

        def order(visit: Visit) -> tuple[float, int]:
            return visit.step, sum(visit.values[k] != self.recipe.get(k) for k in visit.values)

        return sorted((v for v in self.visits if v.prediction and v.status != "dropped"), key=order)

    def count(self, status: str) -> int:
        return sum(v.status == status for v in self.visits)


class Search:
    """The passes of `optimus plan --search` over one recipe at one world size."""

    def __init__(
        self, cfg: OptimusConfig, world: int, machine: MachineModel, fixed: set[str], device: str | None = None,
        jobs: int = 1, say: Callable[[str], None] = lambda line: None,
        predict_fn: Callable | None = None,
    ) -> None:  # fmt: skip
        from optimus.perf.predict import predict

        self.cfg, self.world, self.machine, self.fixed = cfg, world, machine, fixed
        self.device, self.jobs, self.say = device, max(1, jobs), say
        self._predict = predict_fn or (lambda c: predict(c, world, machine, 1.0, "none", device).as_dict())
        self.seen: dict[tuple, Visit] = {}  # by the layout's axis values
        self.counts = count_params_of_config(cfg.model)  # the same model in every layout: counted once
        self.started, self.n_structures = time.perf_counter(), 0
        # Set when the search is stopped: a prediction in flight then ends with its process (the forkserver's
        # "exit code 255"), which is the stop, not the layout's failure.
        self.stopping = threading.Event()

    # ---- one layout

    def _key(self, values: Values) -> tuple:
        return tuple(sorted((k, values[k]) for k in values if k != CHECKPOINTING))

    def planned(self, values: Values) -> Visit:
        """The layout validated and planned, with the least checkpointing that fits (memoised)."""
        key = self._key(values)
        if key not in self.seen:
            self.seen[key] = self._plan(values)
        return self.seen[key]

    def _plan(self, values: Values) -> Visit:
        """The layout with the lightest checkpointing that fits: `full` planned first (a layout it does not fit is
        dropped after one plan), then `none`, then `selective`; the command line's mode alone where it gives one."""
        fixed = CHECKPOINTING in self.fixed
        modes = [_get(self.cfg, CHECKPOINTING)] if fixed else ["full", "none", "selective"]
        fitting = None
        for mode in modes:
            visit = self._plan_mode({**values, CHECKPOINTING: mode})
            if visit.status == "invalid":
                return visit
            if visit.status == "dropped" and fitting is None:  # the first mode tried: the least memory
                visit.reason = f"its planned peak is over the device's memory with {CHECKPOINTING}={mode}"
                return visit
            if visit.status == "fits" and (mode != "full" or fixed):
                return visit
            fitting = visit if visit.status == "fits" else fitting
        return fitting

    def _plan_mode(self, values: Values) -> Visit:
        from optimus.job_scripts import check_groups_in_node
        from optimus.perf.predict import check_predictable
        from optimus.plan import make_plan

        cfg = with_values(self.cfg, values)
        try:
            check_groups_in_node(cfg)
            validate(cfg, self.world)
            check_predictable(cfg)
            memory = make_plan(cfg, self.world, self.counts).memory
        except ConfigError as err:
            return Visit(values, "invalid", str(err))
        status = "fits" if memory["fits_configured"] is not False else "dropped"
        return Visit(values, status, "", memory["total_configured"], memory["device_bytes"])

    def predicted(self, visits: list[Visit]) -> None:
        """Predict the visits that fit and have no prediction yet, `jobs` at once."""
        todo = list({id(v): v for v in visits if v.status == "fits"}.values())  # a layout reached twice: once
        if not todo:
            return

        def one(visit: Visit) -> None:
            try:
                visit.prediction = self._predict(with_values(self.cfg, visit.values))
                visit.status = "predicted"
            except (ConfigError, RuntimeError) as err:
                if self.stopping.is_set():  # its tracing process ended with the stopped command: nothing failed
                    self.say(f"  {_changes(visit.values, self.cfg)}: prediction stopped with the search")
                    return
                visit.status, visit.reason = "failed", str(err).splitlines()[-1]
            self.say(_visit_line(visit, self.cfg))

        pool = ThreadPoolExecutor(self.jobs)
        try:
            list(pool.map(one, todo))
        except BaseException:  # a stop (StopRequested, KeyboardInterrupt): the command ends the tracing processes
            self.stopping.set()
            pool.shutdown(wait=False, cancel_futures=True)  # their threads end as those processes do
            raise
        pool.shutdown()

    # ---- the passes

    def _values(self, axis: str, layout: Values) -> list[Values]:
        """The values to try for `axis` from `layout`: those that keep the axis's fixed keys at the layout's values
        (a pipeline of parallel.pp=1 fixed still takes 1F1B, whatever schedule the recipe names); none where
        every key of the axis is fixed."""
        keys = AXES[axis]
        held = [k for k in keys if k in self.fixed]
        if len(held) == len(keys):
            return []
        values = axis_values(axis, with_values(self.cfg, layout), self.world)
        return [v for v in values if all(v.get(k, layout[k]) == layout[k] for k in held)]

    def _advised(self, axis: str, best: Visit) -> list[Values]:
        """Beside BUCKET_MB's sizes, the bucket size that `best`'s prediction advises for the machine's links
        (optimus.perf.buckets: the smallest that takes every group's reduce-scatter off the latency-bound side),
        where it has bucketed reductions (ZeRO-2) and the bucket size is not fixed."""
        advice = (best.prediction or {}).get("buckets")
        if axis != "bucket" or "optim.bucket_mb" in self.fixed or not advice or advice["advised_mb"] is None:
            return []
        advised = float(advice["advised_mb"])
        return [] if advised in BUCKET_MB else [{"optim.bucket_mb": advised}]

    def structures(self) -> list[Visit]:
        """Every structural layout (the axes of STRUCTURE that are not fixed) with the recipe's other keys, planned."""
        base = values_of(self.cfg, AXIS_KEYS)
        layouts = [base]
        for axis in STRUCTURE:
            layouts = [{**lay, **v} for lay in layouts for v in self._values(axis, lay) or [{}]]
        unique = {self._key(lay): lay for lay in layouts}
        return [self.planned(lay) for lay in unique.values()]

    def descend(self, start: Values, rounds: int = 3) -> Visit:
        """Coordinate descent from `start` over every axis not fixed: the fastest layout found."""
        best = self.planned(start)
        self.predicted([best])
        for _ in range(rounds):
            improved = False
            for axis in AXES:
                here = {k: v for k, v in best.values.items() if k != CHECKPOINTING}
                trials = [
                    self._dividing(self.planned({**here, **v}))
                    for v in self._values(axis, here) + self._advised(axis, best)
                ]
                self.predicted(trials)
                fastest = min([best, *trials], key=lambda v: v.step)
                if fastest.step < best.step:
                    best, improved = fastest, True
            if not improved:
                break
        return best

    def _dividing(self, visit: Visit) -> Visit:
        """`visit`, or where it does not divide, the same layout with the nearest micro-batch that makes it divide
        (smaller first, at equal distance); one axis's value may need another micro-batch, as TP 1 halves each
        data-parallel rank's sequences and with them its micro-batches, fewer than zero bubble needs. Where the
        micro-batch is fixed, or none divides, `visit` as it is."""
        if visit.status != "invalid" or MICRO_BATCH in self.fixed:
            return visit
        here = {k: v for k, v in visit.values.items() if k != CHECKPOINTING}
        sizes = [v[MICRO_BATCH] for v in axis_values("micro_batch", self.cfg, self.world)]
        nearest = sorted((m for m in sizes if m != here[MICRO_BATCH]),
                         key=lambda m: (abs(math.log2(m / here[MICRO_BATCH])), m))  # fmt: skip
        for size in nearest:
            other = self.planned({**here, MICRO_BATCH: size})
            if other.status != "invalid":
                return other
        return visit

    def verify_fastest(self, count: int) -> None:
        """Dry runs of the fastest layouts' busiest ranks until `count` of them fit: one whose dry run measures
        more than the device holds (the planner's peak is an estimate) is dropped with that peak, and the next
        fastest verified in its place; at most 3 x `count` dry runs (each can take minutes)."""
        confirmed, tries = 0, 0
        while confirmed < count and tries < 3 * count:
            unverified = [v for v in self.result().ranked() if v.verified is None]
            if not unverified:
                return
            visit = unverified[0]
            self.verify([visit])
            tries += 1
            if visit.verified.get("fits") is False:
                visit.status, visit.peak_bytes = "dropped", visit.verified["peak_bytes"]
                visit.reason = "its busiest rank's dry run does not fit the device"
            else:  # fits, or the dry run failed (the ranking stands; the failure is reported with the layout)
                confirmed += 1

    def verify(self, visits: list[Visit]) -> None:
        """The busiest rank of each of `visits`, as a dry run in a fresh process: its measured peak."""
        for visit in visits:
            what = _changes(visit.values, self.cfg)
            try:
                visit.verified = verified_peak(with_values(self.cfg, visit.values), self.world, self.device)
            except RuntimeError as err:  # the ranking stands; the failure is reported with the layout
                visit.verified = {"error": str(err).splitlines()[-1]}
                self.say(f"  the dry run of {what} failed: {visit.verified['error']}")
                continue
            fit = "fits" if visit.verified["fits"] is not False else "DOES NOT FIT"
            self.say(f"  verified {what}: rank {visit.verified['rank']} measured "
                     f"{visit.verified['peak_bytes'] / 2**30:.2f} GiB, {fit}")  # fmt: skip

    def result(self) -> SearchResult:
        """What the search has found so far (all of it once `run` returns; part of it where `run` was stopped)."""
        result = SearchResult(self.world, self._nodes(), self.machine.name, self.n_structures,
                              list(self.seen.values()), recipe=values_of(self.cfg))  # fmt: skip
        result.seconds = time.perf_counter() - self.started
        return result

    def run(self, verify: int = 2) -> SearchResult:
        self.started = time.perf_counter()
        structures = self.structures()
        self.n_structures = len(structures)
        fitting = [v for v in structures if v.status == "fits"]
        self.say(
            f"{len(structures)} structural layouts: {len(fitting)} fit, "
            f"{sum(v.status == 'dropped' for v in structures)} do not, "
            f"{sum(v.status == 'invalid' for v in structures)} do not divide or cannot be traced"
        )
        recipe = self.planned(values_of(self.cfg, AXIS_KEYS))
        if recipe.status != "fits" and recipe.status != "predicted":
            if not fitting and not any(v.status == "dropped" for v in structures):
                raise ConfigError(  # every one refused by the config checks: the keys given do not go together
                    "no layout of the search is valid with the keys given on the command line; the recipe's layout "
                    f"with them: {recipe.reason}"
                )
            if not fitting:
                raise ConfigError(
                    "no layout of the search fits the device at this world size: give the run more nodes, or fix "
                    "fewer keys on the command line."
                )
            recipe = min(fitting, key=lambda v: v.values["parallel.pp"])
        self.descend({k: v for k, v in recipe.values.items() if k != CHECKPOINTING})
        self.verify_fastest(verify)
        return self.result()

    def _nodes(self) -> float | None:
        rpn = self.cfg.machine.ranks_per_node
        return self.world / rpn if rpn else None


def verified_peak(cfg: OptimusConfig, world: int, device: str | None) -> dict:
    """{rank, peak_bytes, planned_bytes, fits} of the layout's busiest rank, measured by a dry run in a fresh process
    (optimus.perf.predict.trace_step's reason: torch's caches keyed by DeviceMesh outlive a process group)."""
    import json
    import tempfile
    from pathlib import Path

    from optimus.perf.machine import fresh_process_context

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peak.json"
        child = fresh_process_context().Process(target=_peak_into, args=(cfg, world, device, str(out)))
        child.start()
        child.join()
        result = json.loads(out.read_text()) if out.exists() else {"error": f"exit code {child.exitcode}"}
    if "error" in result:
        raise RuntimeError(f"the dry run that verifies a layout failed: {result['error']}")
    return result


def _peak_into(cfg: OptimusConfig, world: int, device: str | None, out: str) -> None:
    import json
    import traceback
    from pathlib import Path

    from optimus.dry_run import busiest_rank, dry_run_rank
    from optimus.plan import make_plan

    try:
        rank = busiest_rank(make_plan(cfg, world), layout_of(cfg, world))
        memory = dry_run_rank(cfg, world, rank, 1.0, device)["memory"]
        result = {"rank": rank, **{k: memory[k] for k in ("peak_bytes", "planned_bytes", "fits", "device_bytes")}}
    except Exception:
        result = {"error": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))


# ---- the result as text and JSON


def _changes(values: Values, cfg: OptimusConfig) -> str:
    """The keys a layout sets to other values than the recipe, as overrides ('the recipe's' where none)."""
    diff = [f"{k}={_text(v)}" for k, v in values.items() if v != _get(cfg, k)]
    return " ".join(diff) or "the recipe's layout"


def _text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def overrides(values: Values) -> list[str]:
    """A layout as the overrides `optimus train` takes."""
    return [f"{k}={_text(v)}" for k, v in values.items()]


def _visit_line(visit: Visit, cfg: OptimusConfig) -> str:
    what = _changes(visit.values, cfg)
    if visit.prediction is None:
        return f"  {what}: prediction failed: {visit.reason}"
    p = visit.prediction
    return f"  {what}: {p['step_time_s']:.3f} s, MFU {100 * p['mfu']:.1f}%"


def _range(point: float, bounds: list[float] | None, scale: float = 1.0, fmt: str = ".3f") -> str:
    if not bounds:
        return f"{point * scale:{fmt}}"
    return f"{bounds[0] * scale:{fmt}} - {point * scale:{fmt}} - {bounds[1] * scale:{fmt}}"


def format_search(result: SearchResult, cfg: OptimusConfig, top: int = 10) -> list[str]:
    ranked = result.ranked()
    where = f"{result.nodes:g} nodes, " if result.nodes else ""
    lines = [
        f"search on {result.machine} ({where}{result.world} ranks): {result.structures} structural layouts, "
        f"{len(result.visits)} layouts looked at: {len(ranked)} predicted, {result.count('dropped')} do not fit, "
        f"{result.count('invalid')} do not divide or cannot be traced, {result.count('failed')} failed; "
        f"{result.seconds:.0f} s",
        "",
        f"{'#':>3}  {'step s (low - likely - high)':<30}{'MFU %':<20}{'peak GiB':>9}  split / layout (changes)",
    ]
    for i, visit in enumerate(ranked[:top], 1):
        p = visit.prediction
        split = sorted(p["time_split"].items(), key=lambda kv: -kv[1])[:3]
        total = sum(p["time_split"].values()) or 1.0
        parts = ", ".join(f"{k} {100 * s / total:.0f}%" for k, s in split)
        checked = ""
        if visit.verified:
            peak = visit.verified.get("peak_bytes")
            checked = f" (dry run {peak / 2**30:.1f})" if peak is not None else " (dry run failed)"
        lines.append(
            f"{i:>3}  {_range(p['step_time_s'], p.get('step_time_s_range')):<30}"
            f"{_range(p['mfu'], p.get('mfu_range'), 100, '.1f'):<20}{visit.peak_bytes / 2**30:>9.1f}{checked}  {parts}"
        )
        lines.append(f"{'':>5}{_changes(visit.values, cfg)}")
    dropped = sorted((v for v in result.visits if v.status == "dropped"), key=lambda v: v.peak_bytes)
    if dropped:
        lines += ["", f"do not fit ({len(dropped)}; planned or dry-run peak > device), the closest:"]
        for visit in dropped[:3]:
            lines.append(f"  {visit.peak_bytes / 2**30:.1f} > {visit.device_bytes / 2**30:.1f} GiB: "
                         f"{_changes(visit.values, cfg)}")  # fmt: skip
    if ranked:
        lines += ["", "fastest layout, as overrides:", "  " + " ".join(overrides(ranked[0].values))]
        buckets = ranked[0].prediction.get("buckets")
        if buckets:  # the winner's buckets on the machine's links (optimus.perf.buckets), as --predict prints them
            lines.append(f"  {advice_line(BucketAdvice(**buckets))}")
    return lines


def search_json(result: SearchResult) -> dict:
    """The result as one object; the machine model's numbers once (every prediction was replayed on the same)."""
    ranked = result.ranked()
    machine = ranked[0].prediction["machine_numbers"] if ranked else None

    def visit_json(visit: Visit) -> dict:
        out = visit.as_dict()
        if out["prediction"]:
            out["prediction"] = {k: v for k, v in out["prediction"].items() if k != "machine_numbers"}
        return out

    return {
        "machine_numbers": machine,
        "world": result.world, "nodes": result.nodes, "machine": result.machine, "structures": result.structures,
        "recipe": result.recipe,
        "seconds": result.seconds,
        "ranked": [visit_json(v) for v in ranked],
        "dropped": [v.as_dict() for v in result.visits if v.status == "dropped"],
        "invalid": result.count("invalid"), "failed": [v.as_dict() for v in result.visits if v.status == "failed"],
        "winner": {"overrides": overrides(ranked[0].values), **visit_json(ranked[0])} if ranked else None,
    }  # fmt: skip


def fixed_keys(command_line: list[str]) -> set[str]:
    """The search's keys that the command line's overrides set ("parallel.tp=2", "+optim.zero=2"): held fixed."""
    named = {item.split("=", 1)[0].lstrip("+~") for item in command_line if "=" in item}
    return named & set(SEARCH_KEYS)
