"""A rank's step trace replayed on a machine model, and a pipeline schedule played out across its stages.

`Stream` replays events as the device runs them: operators one after another on a compute stream; a
collective the code waits for where it is issued (synchronous) blocks the stream until it ends; an
asynchronous one runs on a communication channel while the stream goes on, and blocks the stream only at
the trace's `wait` for it (the first operator that reads what it wrote), or at the end of the step. Time the
stream spends blocked is exposed communication, by kind.

A channel runs one collective at a time, in issue order. A GPU library (NCCL, RCCL, oneCCL) runs each process
group's collectives on the group's own stream, so collectives of different groups run at once unless they
share links: the replay gives each link class (optimus.perf.costs.group_link: the slowest link a group spans)
a channel of its own, so that an expert all-to-all inside a node runs beside a data-parallel reduction across
nodes, and two collectives that cross the network queue one behind the other (what two at once would take
sharing the NICs). On a CPU (gloo, the `ring` library) the collectives run on the cores the operators run on,
and the replay keeps one channel for all of them.

`play_schedule` runs every pipeline rank's actions in the order its schedule lists them (torch's own
`pipeline_order`): an action starts when its rank is free and its inputs have arrived - a forward after the
previous stage's forward of the micro-batch, a backward after the next stage's backward (the last stage's
after its own forward), a weight backward after its input backward - plus the send between the two ranks.
The rank's gradient reductions issued during its backwards run on its communication channel meanwhile. The
time a rank waits is the pipeline bubble.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from optimus.perf.costs import collective_time, group_link, ops_time
from optimus.perf.machine import MachineModel
from optimus.perf.step_trace import phase_module, place_of_phase

P2P = ("send", "recv")
OPTIMIZER = "optimizer"


def comm_kind(call: dict, tp: int) -> str:
    """What a collective is for: pipeline (send/recv), expert_exchange (the MoE all-to-all),
    tensor_parallel (the layers' collectives among tp consecutive ranks), data_parallel (everything else:
    gradient reductions, parameter gathers, the step's loss and norm reductions)."""
    if call["op"] in P2P:
        return "pipeline"
    direction, module = phase_module(call["phase"])
    in_model = direction is not None and module
    ranks = call["ranks"]
    if in_model and call["op"] == "all_to_all" and module.endswith("ffn"):
        return "expert_exchange"
    consecutive = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    if in_model and len(ranks) == tp > 1 and consecutive:
        return "tensor_parallel"
    return "data_parallel"


ONE_CHANNEL = "all"  # the channel of every collective on a machine whose library runs one at a time (gloo)


def channel_of(machine: MachineModel, call: dict) -> str:
    """The communication channel a collective queues on: its group's slowest link class where the machine's
    library runs each group on a stream of its own (a GPU's), one channel for every collective on a CPU's."""
    if machine.library == "ring":
        return ONE_CHANNEL
    return group_link(machine, call["ranks"])


class AsyncCost(NamedTuple):
    """An async collective as issued: its seconds on its channel, the model part it is of, and the channel."""

    seconds: float
    place: str
    channel: str


@dataclass
class Stream:
    """One rank's compute stream and communication channels (times in seconds from the stream's start)."""

    machine: MachineModel
    rank: int
    tp: int = 1
    t: float = 0.0
    comm_free: dict = field(default_factory=dict)  # channel (channel_of) -> when its last collective ends
    split: Counter = field(default_factory=Counter)  # compute / optimizer / exposed comm by kind
    place_split: Counter = field(default_factory=Counter)  # stream time by (model part, split kind)
    async_cost: dict = field(default_factory=dict)  # async collective id -> AsyncCost
    pending: dict = field(default_factory=dict)  # async collective id -> (end, kind, place)

    def _block_until(self, end: float, kind: str, place: str) -> None:
        if end > self.t:
            self.split[kind] += end - self.t
            self.place_split[(place, kind)] += end - self.t
            self.t = end

    def run(self, events: list[dict], skip_p2p: bool = False) -> Stream:
        for e in events:
            if e["e"] == "ops":
                dt = ops_time(self.machine, e["ops"])
                kind = OPTIMIZER if e["where"] == OPTIMIZER else "compute"
                self.split[kind] += dt
                self.place_split[(e["where"], kind)] += dt
                self.t += dt
            elif e["e"] == "comm":
                call = {**e["call"], "op": e["as"]} if "as" in e else e["call"]
                if skip_p2p and call["op"] in P2P:
                    continue
                cost = collective_time(self.machine, call, self.rank)
                kind, place = comm_kind(call, self.tp), place_of_phase(call["phase"])
                channel = channel_of(self.machine, call)
                end = max(self.t, self.comm_free.get(channel, 0.0)) + cost
                self.comm_free[channel] = end
                if e["async"]:
                    self.pending[e["id"]] = (end, kind, place)
                    self.async_cost[e["id"]] = AsyncCost(cost, place, channel)
                else:
                    self._block_until(end, kind, place)
            elif e["e"] == "wait" and e["id"] in self.pending:
                self._block_until(*self.pending.pop(e["id"]))
        return self

    def in_flight_by_place(self) -> Counter:
        """Channel seconds of the async collectives not yet waited for, by model part."""
        out = Counter()
        for cid in self.pending:
            issued = self.async_cost[cid]
            out[issued.place] += issued.seconds
        return out

    def drain(self) -> float:
        """Wait for every collective still in flight (the step ends with none); the stream's end."""
        for end, kind, place in sorted(self.pending.values()):
            self._block_until(end, kind, place)
        self.pending.clear()
        return self.t


# ---------------------------------------------------------------------------------------------
# The pipeline


@dataclass
class Action:
    type: str  # F, B (full backward), I (input backward), W (weight backward)
    stage: int
    mb: int
    events: list[dict] = field(default_factory=list)


def split_actions(events: list[dict]) -> tuple[list[dict], list[Action], list[dict]]:
    """A pipeline rank's events as (before the first action, the actions, after the last). What runs between
    two actions (the last stage's loss after its forward) belongs to the action before; the sends and
    receives between stages are left to the schedule's play."""
    before, actions, current = [], [], None
    for e in events:
        if e["e"] == "action":
            current = Action(e["type"], e["stage"], e["mb"])
            actions.append(current)
        elif e["e"] == "end":
            continue
        elif current is None:
            before.append(e)
        else:
            current.events.append(e)
    if not actions:
        return before, [], []
    # After the last action's own events, the step's remaining events (optimizer, reductions) come once the
    # schedule has ended: the last action ends at its last operator under a module (or its last collective).
    last = actions[-1]
    cut = max((i for i, e in enumerate(last.events) if _in_action(e)), default=-1) + 1
    last.events, after = last.events[:cut], last.events[cut:]
    return before, actions, after


def _in_action(e: dict) -> bool:
    if e["e"] == "ops":
        return e["where"] not in ("step", OPTIMIZER)
    if e["e"] == "comm":
        return e["call"]["phase"].startswith(("forward", "backward"))
    return False


_ACTION = re.compile(r"^([FBIW])(\d+)_(\d+)$")


def parse_order(order: dict[int, list[str]]) -> dict[int, list[tuple[str, int, int]]]:
    """torch's pipeline_order strings ("F3_7": type, stage, micro-batch), computations only."""
    parsed = {}
    for rank, actions in order.items():
        parsed[int(rank)] = [(m[1], int(m[2]), int(m[3])) for a in actions if (m := _ACTION.match(a))]
    return parsed


def single_stage_order(schedule: str, pp: int, n_micro_batches: int) -> dict[int, list[tuple[str, int, int]]]:
    """The order torch's GPipe and 1F1B schedules run a rank's actions (their `_step_microbatches`): GPipe every
    forward, then every backward; 1F1B min(n, pp - rank) forwards, then a backward and a forward in turn,
    then the backwards left."""
    order = {}
    for rank in range(pp):
        if schedule == "gpipe":
            warmup = n_micro_batches
        elif schedule == "1f1b":
            warmup = min(n_micro_batches, pp - rank)
        else:
            raise ValueError(f"{schedule} is not a single-stage schedule")
        actions = [("F", rank, mb) for mb in range(warmup)]
        forward = warmup
        for backward in range(n_micro_batches):
            actions.append(("B", rank, backward))
            if forward < n_micro_batches and schedule == "1f1b":
                actions.append(("F", rank, forward))
                forward += 1
        order[rank] = actions
    return order


@dataclass
class PipelineResult:
    end: dict[int, float]  # per pipeline rank: when its last action and its reductions have ended
    busy: dict[int, float]  # per pipeline rank: time spent in its actions
    comm_tail: dict[int, float]  # per pipeline rank: reductions still running after its last action
    # per pipeline rank: time its first forwards waited for parameters still gathered from the step before
    held: dict[int, float] = field(default_factory=dict)

    def bubble(self, rank: int) -> float:
        return self.end[rank] - self.comm_tail[rank] - self.busy[rank] - self.held.get(rank, 0.0)


def play_schedule(
    order: dict[int, list[tuple[str, int, int]]],
    n_stages: int,
    action_time,  # (type, stage) -> (seconds, seconds of async collectives issued)
    transfer,  # (from_stage, to_stage) -> seconds to send one micro-batch's activations or gradients
    gates: dict[int, float] | None = None,  # stage -> the earliest its first forward starts (optimus.perf.carried)
    channel_busy: dict[int, float] | None = None,  # rank -> until when its channel runs what the step before left
) -> PipelineResult:
    """Every rank's actions in its order, each starting once its rank is free and its inputs have arrived (a
    stage's first forward also once its `gates` time has come)."""
    done: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(order, 0.0)
    channel = {rank: (channel_busy or {}).get(rank, 0.0) for rank in order}
    busy = dict.fromkeys(order, 0.0)
    held = dict.fromkeys(order, 0.0)
    gates = dict(gates or {})  # each stage's gate holds its first forward only
    position = dict.fromkeys(order, 0)
    remaining = sum(len(actions) for actions in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                kind, stage, mb = actions[position[rank]]
                ready = _inputs_ready(kind, stage, mb, n_stages, done, transfer)
                if ready is None:
                    break
                seconds, async_seconds = action_time(kind, stage)
                start = max(free[rank], ready)
                if kind == "F" and stage in gates:
                    gate = gates.pop(stage)
                    held[rank] += max(0.0, gate - start)
                    start = max(start, gate)
                free[rank] = start + seconds
                channel[rank] = max(channel[rank], start) + async_seconds
                busy[rank] += seconds
                done[(kind, stage, mb)] = free[rank]
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: a[position[r]] for r, a in order.items() if position[r] < len(a)}
            raise ValueError(f"the pipeline schedule cannot proceed: next actions {stuck}")
    end = {r: max(free[r], channel[r]) for r in order}
    return PipelineResult(end=end, busy=busy, comm_tail={r: end[r] - free[r] for r in order}, held=held)


def _inputs_ready(kind, stage, mb, n_stages, done, transfer) -> float | None:
    """When an action's inputs are all in place, or None while one is still to be computed."""
    needs: list[tuple[tuple[str, int, int], float]] = []
    if kind == "F":
        if stage > 0:
            needs.append((("F", stage - 1, mb), transfer(stage - 1, stage)))
    elif kind in ("B", "I"):
        needs.append((("F", stage, mb), 0.0))
        if stage < n_stages - 1:
            after = ("B", stage + 1, mb) if ("B", stage + 1, mb) in done else ("I", stage + 1, mb)
            needs.append((after, transfer(stage + 1, stage)))
    elif kind == "W":
        needs.append((("I", stage, mb), 0.0))
    ready = 0.0
    for key, delay in needs:
        if key not in done:
            return None
        ready = max(ready, done[key] + delay)
    return ready


def mean_by(values: list[tuple[object, float]]) -> dict:
    sums, counts = defaultdict(float), Counter()
    for key, value in values:
        sums[key] += value
        counts[key] += 1
    return {key: sums[key] / counts[key] for key in sums}
