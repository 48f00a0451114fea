"""The collectives a step leaves in flight for the next step's forward, priced in the steady state.

With `optim.overlap_param_gather=true` the optimizer step returns with its parameter all-gathers in flight, and each
part of the model waits for its own parameters when its forward starts (optimus.optim.gather_overlap: the model's
parameters outside the layers at the start, each layer before its own forward). A dry run traces one step, so
those gathers end its trace unwaited; its `carry` event (optimus.perf.step_trace) names, for each, the model parts
whose parameters it writes. Every step of a run but the first begins with the previous step's gathers in flight,
so the replay prices the steady state:

- the step ends when its own work is done, the carried gathers still running (`Carried.left` seconds more);
- its forward (one stage: the first micro-batch's; a pipeline: each stage's first) waits for each gather before the
  part that reads what it writes, with those gathers ahead of the forward's own collectives on their channels.

What that costs the step is what the next step's forward loses to them; the steady state's step pays it once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from optimus.perf.machine import MachineModel
from optimus.perf.replay import Stream


@dataclass
class Carried:
    """An async collective a step leaves in flight for the next forward."""

    left: float  # seconds it still runs after the step's own work has ended
    kind: str  # its split kind (optimus.perf.replay.comm_kind: data_parallel for a parameter gather)
    place: str  # where it was issued (the optimizer)
    places: list[str]  # the model parts whose parameters it writes: each one's forward waits for it
    channel: str  # the channel it holds (optimus.perf.replay.channel_of)


def carried_waits(events: list[dict]) -> dict[int, list[str]]:
    """{collective id: the model parts that wait for it} of a trace's `carry` event; empty where it has none."""
    for e in events:
        if e["e"] == "carry":
            return {int(cid): places for cid, places in e["waits"]}
    return {}


def end_carrying(stream: Stream, waits: dict[int, list[str]]) -> dict[int, Carried]:
    """End a replayed step but for the collectives of `waits` (carried_waits), which it leaves to the next forward:
    the stream waits for every other one in flight; those, with the seconds each still runs after its end."""
    held = {cid: stream.pending.pop(cid) for cid in waits if cid in stream.pending}
    stream.drain()
    return {
        cid: Carried(max(0.0, end - stream.t), kind, place, waits[cid], stream.async_cost[cid].channel)
        for cid, (end, kind, place) in held.items()
    }


def _waits_at_start(carried: Carried) -> bool:
    """The model's own parameters outside its layers (embedding, final norm, head) are waited for before anything
    of the forward runs (the root's pre-hook)."""
    return any(not place.startswith("layers.") for place in carried.places)


def first_forward(events: list[dict]) -> list[dict]:
    """A one-stage step's events up to its first backward operator: its first micro-batch's forward."""
    for i, e in enumerate(events):
        if e["e"] == "ops" and e["bw"]:
            return events[:i]
    return events


def with_carried_waits(events: list[dict], carried: dict[int, Carried]) -> list[dict]:
    """`events` (a forward) with a wait for each carried collective before the first operator of the first part that
    reads what it writes, or at the start for a part outside the layers."""
    out = [{"e": "wait", "id": cid} for cid, c in carried.items() if _waits_at_start(c)]
    left = {cid: set(c.places) for cid, c in carried.items() if not _waits_at_start(c)}
    for e in events:
        if e["e"] == "ops" and not e["bw"]:
            for cid in [cid for cid, places in left.items() if e["where"] in places]:
                out.append({"e": "wait", "id": cid})
                del left[cid]
        out.append(e)
    return out


def carried_delay(
    machine: MachineModel, rank: int, tp: int, forward: list[dict], carried: dict[int, Carried]
) -> Counter:
    """What the carried collectives add to a one-stage step's first forward (`forward`), by split kind: its replay
    with them in flight from its start (ahead of its own collectives on their channels) less its replay without."""
    alone = Stream(machine, rank, tp).run(forward)
    alone.drain()
    busy: dict[str, float] = {}
    for c in carried.values():
        busy[c.channel] = max(busy.get(c.channel, 0.0), c.left)
    waiting = Stream(machine, rank, tp, comm_free=busy)
    waiting.pending = {cid: (c.left, c.kind, c.place) for cid, c in carried.items()}
    waiting.run(with_carried_waits(forward, carried))
    waiting.drain()
    delay = Counter(waiting.split)
    delay.subtract(alone.split)
    return Counter({kind: seconds for kind, seconds in delay.items() if abs(seconds) > 1e-15})


def stage_gate(carried: dict[int, Carried], stage_places: list[str], offset: dict[str, float], start: float) -> float:
    """The earliest a pipeline stage's first forward can start so that each carried collective that writes its
    parameters has landed when the stage reaches the first part that reads it: max over them of (when it lands
    - the forward's seconds before that part), from the schedule's start (`start`: when the step's work before the
    schedule ends). `stage_places`: the stage's parts; `offset`: seconds of the stage's forward before each layer
    (a part outside the layers is waited for at the start)."""
    gate = 0.0
    for c in carried.values():
        mine = [place for place in c.places if place in stage_places]
        if mine:
            before = min(offset.get(place, 0.0) if place.startswith("layers.") else 0.0 for place in mine)
            gate = max(gate, c.left - start - before)
    return gate
