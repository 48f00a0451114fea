"""The parameter all-gathers a step leaves to the next forward (optim.overlap_param_gather), priced in the steady
state (optimus.perf.carried): hand-computed one-stage and pipeline cases, and the dry run's record of them."""

import pytest

from optimus.perf.carried import Carried, carried_delay, end_carrying, first_forward, stage_gate
from optimus.perf.machine import Link
from optimus.perf.replay import Stream, play_schedule, single_stage_order
from tests.perf.test_replay import GB, machine

MS = 1e-3


def hand_machine():
    """machine() with a node link of 10 GB/s and no latency: an all-gather of two ranks of one node takes its
    shard's bytes over 10 GB/s."""
    return machine(node=Link(10 * GB, 0.0))


def ops(where: str, seconds: float, bw: bool = False) -> dict:
    """A run of operators at `where` that takes `seconds` on machine(): one product at 1 TFLOP/s."""
    return {"e": "ops", "where": where, "bw": bw, "ops": [["mm", int(seconds * 1e12), 0, False, None, 1]]}


def gather(cid: int, seconds: float) -> dict:
    """The optimizer's async all-gather of two ranks of one node that takes `seconds`."""
    call = {"op": "all_gather", "ranks": [0, 2], "bytes": int(seconds * 10 * GB), "phase": "optimizer",
            "dtype": "bfloat16"}  # fmt: skip
    return {"e": "comm", "id": cid, "async": True, "call": call}


def one_stage_step(carry: bool) -> list[dict]:
    """Forward: embedding 1 ms, two layers 2 ms each; backward 3 ms; optimizer 1 ms, then two gathers of 4 ms
    (the first writes the embedding's and layer 0's parameters, the second layer 1's), then 0.5 ms more."""
    events = [ops("embed", 1 * MS), ops("layers.0", 2 * MS), ops("layers.1", 2 * MS), ops("layers.0", 3 * MS, True),
              ops("optimizer", 1 * MS), gather(7, 4 * MS), gather(8, 4 * MS), ops("optimizer", 0.5 * MS)]  # fmt: skip
    if carry:
        events.append({"e": "carry", "waits": [[7, ["embed", "layers.0"]], [8, ["layers.1"]]]})
    return events


def test_a_step_that_waits_for_its_gathers_pays_them_at_its_end():
    # Without overlap: the gathers run from 9 ms on the channel, one after the other, and the step waits for both.
    stream = Stream(hand_machine(), 0).run(one_stage_step(carry=False))
    assert stream.drain() == pytest.approx(17 * MS)
    assert stream.split["data_parallel"] == pytest.approx(7.5 * MS)


def test_the_next_forward_waits_for_each_gather_before_the_part_that_reads_it():
    # With overlap the step's own work ends at 9.5 ms, the gathers 3.5 and 7.5 ms later. The next forward waits
    # 3.5 ms at its start (the first gather writes the embedding, which the model waits for first), runs the
    # embedding and layer 0 (to 6.5 ms), waits 1 ms for the second gather before layer 1, and ends at 9.5 ms
    # where it would end at 5 ms alone: the steady-state step is 9.5 + 4.5 = 14 ms, 4.5 ms of it exposed.
    events = one_stage_step(carry=True)
    stream = Stream(hand_machine(), 0).run(events)
    carried = end_carrying(stream, {7: ["embed", "layers.0"], 8: ["layers.1"]})
    assert stream.t == pytest.approx(9.5 * MS)
    assert {cid: c.left for cid, c in carried.items()} == pytest.approx({7: 3.5 * MS, 8: 7.5 * MS})
    assert first_forward(events) == events[:3]
    delay = carried_delay(hand_machine(), 0, 1, first_forward(events), carried)
    assert dict(delay) == pytest.approx({"data_parallel": 4.5 * MS})
    # A gather that writes only a layer's parameters is waited for at that layer: with both on layer 1 alone, the
    # forward runs its first 3 ms while they travel and waits 4.5 ms before layer 1.
    late = {cid: Carried(c.left, c.kind, c.place, ["layers.1"], c.channel) for cid, c in carried.items()}
    assert dict(carried_delay(hand_machine(), 0, 1, first_forward(events), late)) == pytest.approx(
        {"data_parallel": 4.5 * MS}
    )
    early_only = {7: carried[7]}  # only the first: waited for at the start, 3.5 ms
    assert dict(carried_delay(hand_machine(), 0, 1, first_forward(events), early_only)) == pytest.approx(
        {"data_parallel": 3.5 * MS}
    )


def test_a_stage_gate_is_the_latest_landing_less_the_forward_before_its_part():
    # Gathers landing 5 ms (the embedding and layer 0) and 8 ms (layer 1) after the step before, 0.5 ms of work
    # before the schedule, layer 1 starting 3 ms into the stage's forward: the forward must start by
    # max(5 - 0.5 - 0, 8 - 0.5 - 3) = 4.5 ms. A stage that holds none of their parts is not held.
    carried = {1: Carried(5.0, "data_parallel", "optimizer", ["embed", "layers.0"], "network"),
               2: Carried(8.0, "data_parallel", "optimizer", ["layers.1"], "network")}  # fmt: skip
    offsets = {"layers.0": 1.0, "layers.1": 3.0}
    assert stage_gate(carried, ["embed", "layers.0", "layers.1"], offsets, 0.5) == pytest.approx(4.5)
    assert stage_gate(carried, ["layers.2", "head"], {"layers.2": 0.0}, 0.5) == 0.0


def test_a_gate_inside_a_stages_warm_up_costs_nothing_and_one_past_it_delays_the_pipeline():
    # Two-stage 1F1B, forward 1 s and backward 2 s, 4 micro-batches: rank 0 ends at 15 s. Stage 1's first forward
    # waits for stage 0's until 1 s anyway, so a gate at 1 s holds nothing; a gate at 1.5 s holds it 0.5 s, and
    # (worked by hand) every later action of stage 1 and rank 0's backwards shift by 0.5 s: 15.5 s.
    order = single_stage_order("1f1b", 2, 4)

    def cost(kind, stage):
        return ({"F": 1.0, "B": 2.0}[kind], 0.0)

    free = play_schedule(order, 2, cost, lambda a, b: 0.0, gates={1: 1.0})
    assert free.end[0] == pytest.approx(15.0) and free.held == {0: 0.0, 1: 0.0}
    held = play_schedule(order, 2, cost, lambda a, b: 0.0, gates={1: 1.5})
    assert held.end[0] == pytest.approx(15.5) and held.held[1] == pytest.approx(0.5)
    assert held.bubble(1) == pytest.approx(held.end[1] - 12.0 - 0.5)
    # Stage 0's first forward starts the pipeline: a gate there delays every action by it, and is not bubble.
    first = play_schedule(order, 2, cost, lambda a, b: 0.0, gates={0: 2.0})
    assert first.end[0] == pytest.approx(17.0) and first.bubble(0) == pytest.approx(3.0)
    # What the step before left on a rank's channel runs before the reductions its backwards issue.
    reducing = play_schedule(order, 2, lambda kind, stage: (cost(kind, stage)[0], 0.5 if kind == "B" else 0.0),
                             lambda a, b: 0.0, channel_busy={0: 20.0})  # fmt: skip
    assert reducing.end[0] == pytest.approx(20.0 + 4 * 0.5)


@pytest.mark.parametrize("layout", [["parallel.nproc=2"], ["parallel.nproc=4", "parallel.pp=2"]], ids=["dp2", "pp2"])
def test_a_dry_run_with_overlapped_gathers_names_the_parts_each_one_writes(layout):
    # Two data-parallel ranks of the tiny model (dense and expert state sharded over both), alone or on each of two
    # pipeline stages: the step ends with its optimizer's all-gathers in flight, and the trace's carry event names
    # them and, together, every part of the model the rank holds. Replayed, the steady state costs no more than
    # the same traces with their gathers waited for at the end, its compute and optimizer are the same, and its
    # split adds up to its step.
    from optimus.perf.carried import carried_waits
    from optimus.perf.predict import predict_from_traces, trace_step
    from optimus.recipes import load_config
    from tests.conftest import TINY_MODEL

    cfg = load_config([*TINY_MODEL, "train.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
                       "optim.overlap_param_gather=true", *layout])  # fmt: skip
    world = cfg.parallel.nproc
    traces = trace_step(cfg, world, progress="none")
    held = {0: {"embed", "layers.0", "layers.1", "head"}} if cfg.parallel.pp == 1 else {
        0: {"embed", "layers.0"}, 1: {"layers.1", "head"}}  # fmt: skip
    for pp_rank, trace in traces.items():
        events = trace["events"]
        waits = carried_waits(events)
        gathers = {e["id"]: e for e in events if e["e"] == "comm" and e["call"]["op"] == "all_gather"}
        assert waits and set(waits) <= set(gathers)
        assert all(gathers[cid]["async"] and gathers[cid]["call"]["phase"] == "optimizer" for cid in waits)
        assert set().union(*waits.values()) == held[pp_rank]

    waited = {r: {**t, "events": [e for e in t["events"] if e["e"] != "carry"]} for r, t in traces.items()}
    steady, steady_split = predict_from_traces(cfg, world, hand_machine(), traces)
    at_end, at_end_split = predict_from_traces(cfg, world, hand_machine(), waited)
    assert steady <= at_end
    for kind in ("compute", "optimizer"):
        assert steady_split[kind] == pytest.approx(at_end_split[kind])
    assert sum(steady_split.values()) == pytest.approx(steady)
