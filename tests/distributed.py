"""Run a test body on N gloo processes on 127.0.0.1 and collect what each rank returns.

    from tests.distributed import run_distributed

    def body(x):                      # module-level, so children can import it
        t = torch.tensor([dist.get_rank()])
        dist.all_reduce(t)
        return t.item() + x

    assert run_distributed(body, 2, 10) == [11, 11]

`fn(*args)` runs on every rank after `init_process_group("gloo")` (rank and
world size via torch.distributed); its return value must pickle. Children are
forked from a forkserver that has torch imported already, so a run costs well
under a second of start-up instead of one torch import per rank. Rendezvous uses
a TCPStore that the parent opens on a free port (no port races). If a rank
raises, the others are stopped and the child's traceback is re-raised here.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue as queue_lib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_PRELOAD = ["tests.distributed_warmup"]


class DistributedTestError(RuntimeError):
    """A rank of a distributed test body failed; the message holds its traceback."""


@dataclass
class RankOutcome:
    rank: int
    result: Any = None
    error: str | None = None  # the child's formatted traceback, if it raised
    exitcode: int | None = None  # process exit code (negative = killed by that signal)
    reported: bool = False  # the child returned or raised (rather than dying or being stopped)
    reported_at: float = float("inf")  # monotonic time of the report, to find the first failure

    @property
    def ok(self) -> bool:
        return self.reported and self.error is None


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs; harmless then
    return ctx


def _child(fn, args, rank, world_size, port, pg_timeout_s, threads, results) -> None:
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        # Pickled here, by value: a tensor put on the queue as it is travels as a shared-memory handle,
        # which the parent cannot open once this process has exited.
        results.put((rank, pickle.dumps(fn(*args)), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    results.close()
    results.join_thread()


def spawn_ranks(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
    grace_s: float = 3.0,
) -> list[RankOutcome]:
    """Run `fn(*args)` on `world_size` ranks; returns every rank's outcome and never raises for a child.

    A rank that raised gives the others `grace_s` to finish before they are killed (they are
    likely blocked in a collective with it). Ranks still running after `timeout_s` are killed.
    """
    ctx = _context()
    master = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(fn, args, r, world_size, master.port, pg_timeout_s, threads, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes = [RankOutcome(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    try:
        while not all(o.reported or procs[o.rank].exitcode is not None for o in outcomes):
            if time.monotonic() > deadline:
                break
            try:
                rank, result, error = results.get(timeout=0.05)
            except queue_lib.Empty:
                continue
            _record(outcomes[rank], result, error)
            if error is not None:
                deadline = min(deadline, time.monotonic() + grace_s)
        _drain(results, outcomes)
    finally:
        for p in procs:
            p.join(timeout=0.5 if p.exitcode is None else None)
            if p.exitcode is None:
                p.kill()
                p.join()
        _drain(results, outcomes)
        results.close()
    for o, p in zip(outcomes, procs):
        o.exitcode = p.exitcode
    return outcomes


def _record(outcome: RankOutcome, result, error) -> None:
    outcome.result = None if result is None else pickle.loads(result)
    outcome.error, outcome.reported, outcome.reported_at = error, True, time.monotonic()


def _drain(results, outcomes: list[RankOutcome]) -> None:
    """Collect reports of ranks that exited while we were looking elsewhere (their data is in the pipe)."""
    missing = [o for o in outcomes if not o.reported]
    while missing:
        try:
            rank, result, error = results.get(timeout=0.2)
        except (queue_lib.Empty, OSError, ValueError):
            return
        _record(outcomes[rank], result, error)
        missing = [o for o in outcomes if not o.reported]


def run_distributed(fn: Callable, world_size: int, *args, timeout_s: float = 120.0, pg_timeout_s: float = 60.0) -> list:
    """Run `fn(*args)` on `world_size` gloo ranks; returns the per-rank results or raises a child's error."""
    outcomes = spawn_ranks(fn, world_size, args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        first = min(failed, key=lambda o: o.reported_at)  # later failures are usually echoes of the first
        raise DistributedTestError(f"rank {first.rank} of {world_size} raised:\n{first.error}")
    dead = [o for o in outcomes if not o.reported]
    if dead:
        states = ", ".join(
            f"rank {o.rank} "
            + ("was killed or timed out" if o.exitcode in (None, -9) else f"exited with code {o.exitcode}")
            for o in dead
        )
        raise DistributedTestError(f"distributed test body did not finish on every rank: {states}.")
    return [o.result for o in outcomes]
