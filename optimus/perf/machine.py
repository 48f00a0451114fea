"""A machine as the performance model sees it: one device's rates, and the links between devices by class.

A cluster's numbers come from its machine recipe (`machine.perf`, each with its source written beside it);
`machine=local` measures this machine on the spot: the CPU's matrix rates with the threads one rank gets,
its memory bandwidth, the host's time per operator (a CPU runs the host and the kernels in series), gloo's
latency and bandwidth between processes, and what a collective costs ranks that arrive from computing
(optimus.perf.rank_sync: the wake-up of each collective, and the ranks' variability); and, once a step is
traced, each of its operators (`with_timed_ops`, optimus.perf.op_timing), which then take their measured times
instead of the roofline's.

Link classes, from the closest: `package` (devices of one GPU package: an MI250X's two GCDs, a PVC's two
tiles), `node` (devices of one node), `network` (between nodes, through the node's NICs, which all of the
node's devices share).
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context
import os
import signal
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from optimus.config import ConfigError, MachineConfig, MachinePerfConfig
from optimus.perf.collectives import library_of, ring_steps
from optimus.processes import ProcessEnd, quiet_resource_tracker, start_forkserver


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per direction
    latency: float  # seconds per message (per step of a ring or tree)


LINKS = ("package", "node", "network")

# How each number that can carry a range moves a step: higher is faster for these, slower for the rest (the
# latencies and the kernel floor). Every operator's and collective's time (optimus.perf.costs) is monotone in
# each of them, and a replay without a pipeline composes those times in a fixed order with sums and maxima, so
# its step is too: the two ends of MachineModel.at_end bound it over every combination inside the ranges.
FASTER_WHEN_HIGHER = ("peak_flops_fp32", "gemm_efficiency", "attention_efficiency", "memory_bandwidth",
                      "package.bandwidth", "node.bandwidth", "network.bandwidth")  # fmt: skip
SLOWER_WHEN_HIGHER = ("kernel_floor", "package.latency", "node.latency", "network.latency", "rank_variability",
                      "sync_cost")  # fmt: skip

# machine.perf.<key> (optimus.config.RANGED_PERF_KEYS) -> (the number's name in the model, the unit's scale).
_MODEL_NUMBER = {
    "peak_flops_fp32": ("peak_flops_fp32", 1.0), "gemm_efficiency": ("gemm_efficiency", 1.0),
    "attention_efficiency": ("attention_efficiency", 1.0), "memory_bandwidth_gbs": ("memory_bandwidth", 1e9),
    "kernel_floor_us": ("kernel_floor", 1e-6), "package_gbs": ("package.bandwidth", 1e9),
    "package_latency_us": ("package.latency", 1e-6), "node_gbs": ("node.bandwidth", 1e9),
    "node_latency_us": ("node.latency", 1e-6), "nic_gbs": ("network.bandwidth", 1e9),
    "network_latency_us": ("network.latency", 1e-6), "rank_variability": ("rank_variability", 1.0),
    "sync_cost_us": ("sync_cost", 1e-6),
}  # fmt: skip


@dataclass(frozen=True)
class MachineModel:
    name: str
    peak_flops: float  # bf16 matrix FLOP/s per device
    peak_flops_fp32: float
    gemm_efficiency: float  # fraction of the peak a large matrix product reaches
    attention_efficiency: float  # ... an attention kernel (FLOPs of the work it does, optimus.perf.step_trace)
    memory_bandwidth: float  # bytes/s per device, of a large elementwise kernel
    kernel_floor: float  # seconds: the shortest kernel
    ranks_per_node: int
    devices_per_package: int
    package: Link
    node: Link
    network: Link  # one NIC
    nics_per_node: int
    # The collective library its ranks use, which chooses each collective's algorithm (optimus.perf.collectives).
    library: str = "ring"
    rank_variability: float = 0.0  # a rank's step time's coefficient of variation (optimus.perf.stragglers)
    # Seconds every collective costs beyond its transfer where the ranks wake each other on the cores they compute
    # on (a CPU: optimus.perf.rank_sync); 0 for GPUs.
    sync_cost: float = 0.0
    host_op: float = 0.0  # seconds of host time per kernel, in series with it (CPU devices); 0 for GPUs
    host_view: float = 0.0  # ... per view or allocation
    # Measured (bytes moved, bytes/s) of elementwise kernels by size, where caches make small kernels faster
    # than the memory (a CPU); empty: memory_bandwidth at every size.
    bandwidth_by_size: tuple[tuple[float, float], ...] = ()
    # Threads a rank's operators run with where they can be timed on this machine (local: each operator of the
    # traced step is, optimus.perf.op_timing); 0 where the roofline prices them. The times, by signature:
    op_threads: int = 0
    op_seconds: dict[str, float] = field(default_factory=dict)
    # The operator times' range, a fraction either side, which the interval's ends take (a calibration's); 0: exact.
    op_spread: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)
    # The range of each uncertain number, by its name here ("gemm_efficiency", "node.bandwidth", ...), as (low,
    # high) in the model's units (machine.perf.ranges, optimus.config); empty where every number is taken as exact.
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)

    def at_end(self, end: str) -> MachineModel:
        """The machine with every ranged number at the end of its range that makes a step `fast` (bandwidths,
        rates and efficiencies high, latencies and the kernel floor low) or `slow` (the other way)."""
        if end not in ("fast", "slow"):
            raise ValueError(f"end={end!r}: use 'fast' or 'slow'.")
        changes: dict = {}
        links = {name: getattr(self, name) for name in LINKS}
        for name, (low, high) in self.ranges.items():
            value = high if (name in FASTER_WHEN_HIGHER) == (end == "fast") else low
            link, _, attr = name.partition(".")
            if attr:
                links[link] = replace(links[link], **{attr: value})
            else:
                changes[name] = value
        if self.op_spread:
            factor = 1 - self.op_spread if end == "fast" else 1 + self.op_spread
            changes["op_seconds"] = {sig: seconds * factor for sig, seconds in self.op_seconds.items()}
        return replace(self, **changes, **links, ranges={}, op_spread=0.0)

    def bandwidth_at(self, moved: float) -> float:
        """Bytes/s of a kernel that moves `moved` bytes (log-linear between the measured sizes)."""
        table = self.bandwidth_by_size
        if not table:
            return self.memory_bandwidth
        if moved <= table[0][0]:
            return table[0][1]
        for (s0, b0), (s1, b1) in zip(table, table[1:]):
            if moved <= s1:
                f = math.log(moved / s0) / math.log(s1 / s0)
                return b0 + f * (b1 - b0)
        return table[-1][1]

    def with_values(self, **changes) -> MachineModel:
        """A copy with some numbers changed (the sensitivity table scales them one at a time)."""
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, numbers: dict) -> MachineModel:
        """The model from its `dataclasses.asdict` (a prediction's `machine_numbers`)."""
        links = {key: Link(**numbers[key]) for key in LINKS}
        table = tuple(tuple(row) for row in numbers.get("bandwidth_by_size", ()))
        ranges = {name: tuple(bounds) for name, bounds in numbers.get("ranges", {}).items()}
        return cls(**{**numbers, **links, "bandwidth_by_size": table, "ranges": ranges})


# The recipe keys every cluster needs, and what to write when one is missing.
_NETWORK = ("nic_gbs", "nics_per_node", "network_latency_us")
_NODE = ("node_gbs", "node_latency_us")
_REQUIRED = ("gemm_efficiency", "memory_bandwidth_gbs", "kernel_floor_us", *_NODE, *_NETWORK)


def measured_here(machine: MachineConfig) -> bool:
    """Whether the machine's model is this machine, measured on the spot (machine=local), not a recipe's numbers."""
    return machine.name == "local"


def times_operators(machine: MachineConfig) -> bool:
    """Whether the machine's model prices operators by their measured times, so that the trace must record their
    signatures: machine=local times them here (measure_local sets its op_threads); a calibration holds those
    the device ran (machine.perf.operator_times)."""
    return measured_here(machine) or bool(machine.perf.operator_times)


def _timed_operators(path: str | None) -> tuple[dict[str, float], float, dict[str, str]]:
    """(op_seconds, op_spread, sources) of machine.perf.operator_times: nothing where it is null."""
    from optimus.perf.op_timing import read_operator_times

    if not path:
        return {}, 0.0, {}
    seconds, measured, spread = read_operator_times(path)
    where = ", ".join(str(measured[key]) for key in ("device", "host", "date") if measured.get(key))
    where += f", torch {measured['torch']}" if measured.get("torch") else ""
    step = f", of the step of {measured['step']}" if measured.get("step") else ""
    note = f"{path}: {len(seconds)} operators timed on {where or 'the device'}{step}, +-{spread:.0%}"
    return seconds, spread, {"operators": note}


def machine_model(machine: MachineConfig, nproc: int = 1) -> MachineModel:
    """The model of the recipe's machine; `local` is measured here for `nproc` ranks on this machine."""
    if measured_here(machine):
        return measure_local(nproc)
    p = machine.perf
    # Ranks on one node send nothing over a network: a machine measured on one node (a calibration) has no NIC.
    one_node = bool(machine.ranks_per_node) and nproc <= machine.ranks_per_node
    # ... and one rank sends nothing at all: a calibration of one process has no link.
    required = [key for key in _REQUIRED if not (one_node and key in _NETWORK) and not (nproc == 1 and key in _NODE)]
    missing = [f"machine.perf.{key}" for key in required if getattr(p, key) is None]
    missing += [f"machine.{key}" for key in ("peak_flops", "ranks_per_node") if not getattr(machine, key)]
    if missing:
        raise ConfigError(
            f"machine={machine.name} has no performance model ({', '.join(missing)} unset): set them in "
            f"recipes/machine/{machine.name}.yaml (or as overrides), with each number's source."
        )
    has_node = None not in (p.node_gbs, p.node_latency_us)
    node = Link(p.node_gbs * 1e9, p.node_latency_us * 1e-6) if has_node else Link(math.inf, 0.0)  # one rank: unused
    has_network = None not in (p.nic_gbs, p.network_latency_us)
    network = Link(p.nic_gbs * 1e9, p.network_latency_us * 1e-6) if has_network else node  # one node: unused
    package_latency = p.package_latency_us if p.package_latency_us is not None else p.node_latency_us
    package = Link(p.package_gbs * 1e9, package_latency * 1e-6) if p.package_gbs else node
    op_seconds, op_spread, op_sources = _timed_operators(p.operator_times)
    return MachineModel(
        name=machine.name,
        peak_flops=float(machine.peak_flops),
        peak_flops_fp32=float(p.peak_flops_fp32 or machine.peak_flops / 4),
        gemm_efficiency=p.gemm_efficiency,
        attention_efficiency=p.attention_efficiency or p.gemm_efficiency,
        memory_bandwidth=p.memory_bandwidth_gbs * 1e9,
        kernel_floor=p.kernel_floor_us * 1e-6,
        ranks_per_node=machine.ranks_per_node,
        devices_per_package=p.devices_per_package,
        package=package,
        node=node,
        network=network,
        nics_per_node=p.nics_per_node or 1,
        library=library_of(machine.device, machine.backend),
        rank_variability=p.rank_variability or 0.0,
        sync_cost=(p.sync_cost_us or 0.0) * 1e-6,
        op_seconds=op_seconds,
        op_spread=op_spread,
        sources={"recipe": machine.calibration or f"recipes/machine/{machine.name}.yaml", **op_sources},
        ranges=model_ranges(p),
    )


def model_ranges(perf: MachinePerfConfig) -> dict[str, tuple[float, float]]:
    """machine.perf.ranges in the model's names and units. A number that stands in for another where the recipe
    leaves it null takes that one's range too: attention's efficiency the GEMM's, the package link the node's."""
    ranges = {}
    for key, (low, high) in perf.ranges.items():
        name, scale = _MODEL_NUMBER[key]
        ranges[name] = (low * scale, high * scale)
    stand_ins = {"attention_efficiency": ("gemm_efficiency", perf.attention_efficiency)}
    stand_ins |= {"package.latency": ("node.latency", perf.package_latency_us if perf.package_gbs else None)}
    stand_ins |= {"package.bandwidth": ("node.bandwidth", perf.package_gbs)}
    for name, (source, own_value) in stand_ins.items():
        if own_value is None and source in ranges:
            ranges[name] = ranges[source]
    return ranges


# ---------------------------------------------------------------------------------------------
# machine=local: measured


def fresh_process_context():
    """The multiprocessing context for the model's measuring and tracing processes, each of which must start
    clean (its own threads and malloc settings; no DeviceMesh of an earlier world in torch's caches): forked
    from a forkserver where there is one (a process that imported torch and optimus.perf and built nothing,
    so a child starts in a fraction of a second instead of importing torch again), spawned elsewhere. Its
    processes end with the command that started them (`_CommandBound`)."""
    quiet_resource_tracker()  # shared with the processes: no warning about the semaphores of one that was killed
    if not start_forkserver(["optimus.perf.predict"]):  # the preload: none once the server runs
        return _SpawnContext()
    return _ForkServerContext()


class _CommandBound:
    """A measuring or tracing process that ends with the command that started it, however that ended (a stop
    signal, kill -9): nobody reads its result then, and while it runs, the forkserver and the resource tracker,
    which outlive their clients, run too. A Ctrl-C reaches it with the terminal's whole group: the command
    decides (it ends its processes as it ends), so the process ignores it instead of printing a traceback."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.command_pid = os.getpid()

    def start(self):
        with _stop_signals_held():
            super().start()

    def run(self):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked in the forkserver (ctrl_c_held)
        watch = threading.Thread(target=_exit_after, args=(self.command_pid,), name="optimus-command", daemon=True)
        watch.start()
        super().run()


@contextmanager
def _stop_signals_held():
    """A stop signal waits for the end of the block, then takes effect as it would have: a process interrupted
    while it starts (forked, but its task not yet written to it, or its queue's semaphores about to be removed
    by its parent's exit) would be left behind, or print a traceback as it fails to read them."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets Python's signals
        yield
        return
    from optimus.local_launcher import FORWARDED_SIGNALS  # the stop signals

    held = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        for signum in held:
            os.kill(os.getpid(), signum)


def _exit_after(pid: int) -> None:
    """End this process once process `pid` has ended."""
    ProcessEnd(pid).wait()
    os._exit(1)


if "forkserver" in multiprocessing.get_all_start_methods():

    class _ForkServerProcess(_CommandBound, multiprocessing.context.ForkServerProcess):
        pass

    class _ForkServerContext(multiprocessing.context.ForkServerContext):
        Process = _ForkServerProcess


class _SpawnProcess(_CommandBound, multiprocessing.context.SpawnProcess):
    pass


class _SpawnContext(multiprocessing.context.SpawnContext):
    Process = _SpawnProcess


def _best_time(fn, seconds: float) -> float:
    """The fastest of repeated calls for about `seconds` (the undisturbed time on a shared machine)."""
    fn()
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        start = time.perf_counter()
        fn()
        t = time.perf_counter() - start
        best, spent = min(best, t), spent + t
    return best


def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Elementwise kernels a training step is made of, for the measured bandwidth: (name, dtype, kernel).
_BASKET = (
    ("mul bf16", torch.bfloat16, lambda x: torch.mul(x, x)),
    ("add fp32", torch.float32, lambda x: torch.add(x, x)),
    ("exp fp32", torch.float32, torch.exp),
    ("silu bf16", torch.bfloat16, torch.nn.functional.silu),
    ("bf16 to fp32", torch.bfloat16, lambda x: x.float()),
    ("sum fp32", torch.float32, lambda x: x.sum(-1)),
)
_SIZES = (2**16, 2**19, 2**22, 2**25)  # bytes read: from inside a core's cache to far beyond the last level


def _moved(x: torch.Tensor, y: torch.Tensor) -> int:
    return x.numel() * x.element_size() + y.numel() * y.element_size()


def measure_cpu(threads: int, seconds: float = 0.3) -> dict:
    """This CPU's rates with `threads` threads, with glibc keeping freed memory as a training run does
    (optimus.cpu_runtime.keep_cpu_allocations): matrix FLOP/s (bf16, fp32) at a training-like size and of causal
    attention (the fastest of repeated runs: a shared machine's undisturbed rate); the median bytes/s of a
    basket of elementwise kernels at four sizes; the host's time per operator (a tiny add; a view)."""
    from optimus.cpu_runtime import keep_cpu_allocations

    keep_cpu_allocations()
    torch.set_num_threads(threads)
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(512, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)  # [M, K], [K, N]
        rates[dtype] = 2 * 512 * 1024 * 1024 / _best_time(partial(torch.mm, a, b), seconds)
    by_size = []
    for size in _SIZES:
        speeds = []
        for _, dtype, kernel in _BASKET:
            rows = size // torch.empty((), dtype=dtype).element_size() // 256
            x = torch.randn(rows, 256, dtype=dtype)  # [R, 256]
            speeds.append(_moved(x, kernel(x)) / _median_time(partial(kernel, x), 7))
        by_size.append((2.0 * size, statistics.median(speeds)))  # keyed by bytes moved: read and written
    rates["attention"] = _attention_rate(seconds)
    x, y = torch.randn(8), torch.randn(8)
    add = _median_time(lambda: [torch.add(x, y) for _ in range(200)], 5) / 200
    view = _median_time(lambda: [x.view(2, 4) for _ in range(200)], 5) / 200
    return {"bf16": rates[torch.bfloat16], "fp32": rates[torch.float32], "attention": rates["attention"],
            "by_size": by_size,
            "host_op": add, "host_view": view}  # fmt: skip


def _attention_rate(seconds: float) -> float:
    """FLOP/s of causal bf16 attention, forward and backward, at q, k, v [4, 8, 512, 64]."""
    from optimus.operators import attention_flops

    q, k, v = (torch.randn(4, 8, 512, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    flops = attention_flops(q, k, True, False) + attention_flops(q, k, True, True)
    return flops / _best_time(step, seconds)


def _cpu_process(threads: int, results) -> None:
    results.put(measure_cpu(threads))


def _gloo_rank(rank: int, world: int, init_file: str, sizes: list[int], results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    times = []
    for numel in sizes:
        x = torch.randn(numel)

        def reduce(x=x):
            dist.barrier()
            dist.all_reduce(x)

        barrier = _median_time(dist.barrier, 7)
        times.append(max(_median_time(reduce, 7) - barrier, 1e-7))
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def measure_gloo(world: int = 2) -> Link:
    """gloo between `world` processes here: latency and bandwidth fitted to all-reduces of two sizes, as
    optimus.perf.costs prices them."""
    sizes = [256, 2**22]  # 1 KiB, 16 MiB
    small, large = _rank_zero_of_gloo_group(world, _gloo_rank, sizes)
    # As optimus.perf.costs prices an all-reduce on gloo: a ring's steps, and 2 (n - 1) / n of the buffer.
    latency = small / ring_steps("all_reduce", world)
    volume = 2 * (world - 1) / world * (sizes[1] - sizes[0]) * 4
    return Link(bandwidth=volume / max(large - small, 1e-9), latency=latency)


def measure_sync(world: int = 2) -> tuple[float, float]:
    """(sync_cost, rank_variability) of `world` gloo processes here, each computing on one thread
    (optimus.perf.rank_sync)."""
    from optimus.perf.rank_sync import fit_sync, sync_rank

    measured, aligned = _rank_zero_of_gloo_group(world, sync_rank)
    return fit_sync(measured, aligned, world)


def _rank_zero_of_gloo_group(world: int, target, *args):
    """What rank 0 of `world` fresh processes, each running target(rank, world, init_file, *args, queue) with a
    gloo group among them, put in the queue."""
    ctx = fresh_process_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=target, args=(r, world, init, *args, results)) for r in range(world)]
        (result,) = _results_of(procs, results, count=1)
    return result


def _in_processes(n: int, target, *args, timeout_s: float = 300.0) -> list:
    """target(*args, queue) run in `n` fresh processes at once; what each put in the queue."""
    ctx = fresh_process_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, results)) for _ in range(n)]
    return _results_of(procs, results, count=n, timeout_s=timeout_s)


def _results_of(procs: list, results, count: int, timeout_s: float = 300.0) -> list:
    """Start `procs` and return the first `count` things they put in `results`. Stopped meanwhile (Ctrl-C, a
    stop signal) or failing, this kills them at once rather than wait for them: they end with the command."""
    started = []
    try:
        for proc in procs:
            proc.start()
            started.append(proc)
        return [_result(results, procs, timeout_s) for _ in range(count)]
    except BaseException:
        for proc in started:
            proc.kill()
        raise
    finally:
        for proc in started:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _in_a_process(target, *args):
    """target(*args, queue) run in a fresh process; what it puts in the queue."""
    return _in_processes(1, target, *args)[0]


def _result(results, procs, timeout_s: float = 300.0):
    """What a measuring process put in `results`; an error naming the measurement if every process ended (or
    `timeout_s` passed) without one."""
    import queue

    waited, ended = 0.0, False
    while True:
        try:
            return results.get(timeout=5.0)
        except queue.Empty:
            waited += 5.0
            if ended or waited >= timeout_s:  # a result put just before its process ended had one more wait
                codes = [proc.exitcode for proc in procs]
                raise RuntimeError(f"measuring this machine for machine=local failed (exit codes {codes})") from None
            ended = not any(proc.is_alive() for proc in procs)


def _op_timing_process(signatures: list[str], threads: int, results) -> None:
    from optimus.perf.op_timing import cpu_times

    results.put(cpu_times(signatures, threads))


def timed_by_every_rank(signatures: list[str], threads: int, ranks: int) -> dict[str, float]:
    """Each signature's mean time over `ranks` processes timing them all at once, `threads` threads each: the
    ranks of a run share this machine's memory bandwidth and caches as they compute."""
    timeout_s = 300.0 + 2.0 * len(signatures)  # five rounds of each, most under a millisecond
    timed = _in_processes(ranks, _op_timing_process, signatures, threads, timeout_s=timeout_s)
    return {sig: statistics.mean(t[sig] for t in timed) for sig in timed[0] if all(sig in t for t in timed)}


def with_timed_ops(machine: MachineModel, traces: dict[int, dict]) -> MachineModel:
    """The machine with every operator of `traces` timed on it, where it times operators (op_threads), by as
    many processes at once as it has ranks; the count of timed and untimed (roofline) operators, or why none
    was timed, in its sources."""
    from optimus.perf.op_timing import traced_signatures

    if not machine.op_threads:
        return machine
    signatures = traced_signatures(traces)
    try:
        seconds = timed_by_every_rank(signatures, machine.op_threads, machine.ranks_per_node)
    except RuntimeError as err:  # a timing process that died (out of memory): the roofline prices them all
        note = f"none of the {len(signatures)} distinct operators of the traced step timed ({err}): roofline"
        return replace(machine, sources={**machine.sources, "operators": note})
    note = (
        f"{len(seconds)} distinct operators of the traced step timed here by {machine.ranks_per_node} "
        f"process(es) at once, {len(signatures) - len(seconds)} not"
    )
    return replace(machine, op_seconds=seconds, sources={**machine.sources, "operators": note})


_local_cache: dict[int, MachineModel] = {}


def measure_local(nproc: int) -> MachineModel:
    """This machine for `nproc` ranks, each with its share of the cores (as `optimus train` gives them)."""
    from optimus.cpu_runtime import available_cores

    if nproc not in _local_cache:
        threads = max(1, len(available_cores()) // nproc)
        cpu = _in_a_process(_cpu_process, threads)  # its malloc settings and threads stay there
        peers = max(2, min(nproc, 4))
        link = measure_gloo(peers)
        sync_cost, variability = measure_sync(peers) if nproc > 1 else (0.0, 0.0)
        _local_cache[nproc] = MachineModel(
            name="local",
            peak_flops=cpu["bf16"],
            peak_flops_fp32=cpu["fp32"],
            gemm_efficiency=1.0,  # the rates are measured at a training-sized product, not a datasheet peak
            attention_efficiency=cpu["attention"] / cpu["bf16"],
            memory_bandwidth=cpu["by_size"][-1][1],
            bandwidth_by_size=tuple(cpu["by_size"]),
            kernel_floor=0.0,
            ranks_per_node=max(nproc, 1),
            devices_per_package=1,
            package=link,
            node=link,
            network=link,
            nics_per_node=1,
            host_op=cpu["host_op"],
            host_view=cpu["host_view"],
            sync_cost=sync_cost,
            rank_variability=variability,
            op_threads=threads,
            sources={"measured": f"this machine, {threads} thread(s) per rank, gloo between {peers} processes"},
        )
    return _local_cache[nproc]
