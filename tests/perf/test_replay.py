"""The performance model's replay against cases computed by hand: a ring all-reduce on a known link (the vendor
libraries' other algorithms: test_collectives.py), an all-to-all across nodes, a CPU's wake-up per collective and
its fit, an overlapped reduce-scatter, and a two-stage pipeline with its known bubble."""

import math

import pytest

from optimus.perf.costs import collective_time, op_time
from optimus.perf.machine import Link, MachineModel
from optimus.perf.rank_sync import fit_sync
from optimus.perf.replay import Stream, play_schedule, single_stage_order

GB = 1e9


def machine(**changes) -> MachineModel:
    """4 devices per node, 2 per package; 1 TFLOP/s at full efficiency, 100 GB/s memory, 2 NICs of 25 GB/s."""
    values = dict(
        name="hand", peak_flops=1e12, peak_flops_fp32=0.5e12, gemm_efficiency=1.0, attention_efficiency=0.5,
        memory_bandwidth=100 * GB, kernel_floor=0.0, ranks_per_node=4, devices_per_package=2,
        package=Link(100 * GB, 1e-6), node=Link(10 * GB, 5e-6), network=Link(25 * GB, 10e-6), nics_per_node=2,
    )  # fmt: skip
    values.update(changes)
    return MachineModel(**values)


def test_operator_roofline():
    m = machine(kernel_floor=3e-6)
    assert op_time(m, "mm", 2e9, 1e6, False) == pytest.approx(2e-3)  # compute-bound: 2 GFLOP at 1 TFLOP/s
    assert op_time(m, "mm", 2e9, 1e6, True) == pytest.approx(4e-3)  # fp32 peak
    assert op_time(m, "mm", 1e6, 1e9, False) == pytest.approx(1e-2)  # bytes-bound: 1 GB at 100 GB/s
    assert op_time(m, "attn", 1e9, 0, False) == pytest.approx(2e-3)  # attention at half the peak
    assert op_time(m, "mem", 0, 100, False) == pytest.approx(3e-6)  # no kernel is shorter than the floor
    assert op_time(m, "view", 0, 0, False) == 0.0


def test_ring_all_reduce_inside_a_node():
    # 4 ranks of one node (two packages): a ring over the node link moves 2 (n-1)/n of 1 GB in 2 (n-1) steps.
    call = {"op": "all_reduce", "ranks": [0, 1, 2, 3], "bytes": 10**9}
    assert collective_time(machine(), call, 0) == pytest.approx(2 * 3 / 4 * 1e9 / (10 * GB) + 2 * 3 * 5e-6)
    # Two ranks of one package use the package link.
    pair = {"op": "all_reduce", "ranks": [0, 1], "bytes": 10**9}
    assert collective_time(machine(), pair, 0) == pytest.approx(1e9 / (100 * GB) + 2 * 1e-6)


def test_ring_all_reduce_across_nodes_shares_the_nics():
    # One member per node, 4 ranks per node all reducing at once: each group gets 2 NICs x 25 GB/s / 4.
    call = {"op": "all_reduce", "ranks": [0, 4], "bytes": 10**9}
    assert collective_time(machine(), call, 0) == pytest.approx(1e9 / (12.5 * GB) + 2 * 10e-6)
    # Reduce-scatter (the whole buffer) and all-gather (one shard) over the same ring move (n-1)/n of it.
    rs = {"op": "reduce_scatter", "ranks": [0, 4], "bytes": 10**9}
    ag = {"op": "all_gather", "ranks": [0, 4], "bytes": 5 * 10**8}
    assert collective_time(machine(), rs, 0) == pytest.approx(0.5e9 / (12.5 * GB) + 10e-6)
    assert collective_time(machine(), ag, 0) == pytest.approx(collective_time(machine(), rs, 0))


def test_all_to_all_by_link_class():
    # Rank 0 sends 100 rows of 1 MB to each of ranks 1 (same package), 2 (same node) and 4 (another node).
    call = {"op": "all_to_all", "ranks": [0, 1, 2, 4], "bytes": 400 * 10**6,
            "splits": {"send": [100, 100, 100, 100], "recv": [100, 100, 100, 100]}}  # fmt: skip
    # gloo sends to every peer at once: each link class its latency and its bytes, the slowest class the time.
    off_node = 1e8 * 4 / (2 * 25 * GB)  # every rank of the node sends through the node's two NICs at once
    expected = max(1e-6 + 1e8 / (100 * GB), 5e-6 + 1e8 / (10 * GB), 10e-6 + off_node)
    assert collective_time(machine(), call, 0) == pytest.approx(expected)


def _ops(seconds: float) -> dict:
    """A run of operators that takes `seconds` on machine(): one matrix product at 1 TFLOP/s."""
    return {"e": "ops", "where": "layers.0", "bw": True, "ops": [["mm", int(seconds * 1e12), 0, False, None, 1]]}


def _reduce_scatter(cid: int, seconds: float, is_async: bool) -> dict:
    """A reduce-scatter between two packages of a node taking `seconds` (2 ranks: half the buffer moves)."""
    size = int(seconds * 10 * GB * 2)
    call = {"op": "reduce_scatter", "ranks": [0, 2], "bytes": size, "phase": "backward", "dtype": "float32"}
    return {"e": "comm", "id": cid, "async": is_async, "call": call}


def test_overlapped_reduce_scatter():
    m = machine(node=Link(10 * GB, 0.0))
    # Issued after the first second of backward, overlapping the second: hidden when it takes 0.5 s.
    hidden = [_ops(1.0), _reduce_scatter(0, 0.5, True), _ops(1.0), {"e": "wait", "id": 0}]
    stream = Stream(m, rank=0).run(hidden)
    assert stream.drain() == pytest.approx(2.0)
    assert stream.split["data_parallel"] == 0
    # Taking 1.5 s, it shows for 0.5 s at its wait.
    exposed = [_ops(1.0), _reduce_scatter(0, 1.5, True), _ops(1.0), {"e": "wait", "id": 0}]
    stream = Stream(m, rank=0).run(exposed)
    assert stream.drain() == pytest.approx(2.5)
    assert stream.split["data_parallel"] == pytest.approx(0.5)
    # Synchronous, it blocks the stream for all of it; two async ones of one group queue on its channel.
    assert Stream(m, 0).run([_ops(1.0), _reduce_scatter(0, 0.5, False), _ops(1.0)]).drain() == pytest.approx(2.5)
    queued = [_reduce_scatter(0, 1.0, True), _reduce_scatter(1, 1.0, True), _ops(1.5), {"e": "wait", "id": 1}]
    assert Stream(m, 0).run(queued).drain() == pytest.approx(2.0)


def test_a_gpu_librarys_collectives_queue_by_link_class():
    # NCCL runs each group on a stream of its own. A reduce-scatter across nodes (ranks 0 and 4) and then an
    # all-gather across nodes are issued asynchronously: the gather queues behind the reduce-scatter on the
    # network's channel. A synchronous all-reduce inside the node (ranks 0 and 2) starts at once beside them. gloo
    # (the `ring` library) runs one collective at a time: the all-reduce waits for both. Each cost is
    # collective_time's; what is checked is how the replay composes them.
    across = {"op": "reduce_scatter", "ranks": [0, 4], "bytes": 10**9, "phase": "backward", "dtype": "float32"}
    gather = {"op": "all_gather", "ranks": [0, 4], "bytes": 10**8, "phase": "optimizer", "dtype": "bfloat16"}
    inside = {"op": "all_reduce", "ranks": [0, 2], "bytes": 10**8, "phase": "forward layers.0", "dtype": "bfloat16"}
    events = [{"e": "comm", "id": 1, "async": True, "call": across}, {"e": "comm", "id": 2, "async": True,
              "call": gather}, {"e": "comm", "id": 3, "async": False, "call": inside}, _ops(0.01),
              {"e": "wait", "id": 1}, {"e": "wait", "id": 2}]  # fmt: skip
    for library in ("nccl", "ring"):
        m = machine(library=library)
        rs, ag, ar = (collective_time(m, call, 0) for call in (across, gather, inside))
        assert rs > ar + 0.01  # the reduce-scatter outlasts the all-reduce and the operators
        stream = Stream(m, 0).run(events)
        if library == "nccl":  # the all-reduce and the operators end at ar + 0.01; the gather at rs + ag
            assert stream.t == pytest.approx(rs + ag)
            assert stream.split["data_parallel"] == pytest.approx(rs + ag - 0.01)
        else:  # the all-reduce starts when the gather ends; nothing is left to wait for after the operators
            assert stream.t == pytest.approx(rs + ag + ar + 0.01)
            assert stream.split["data_parallel"] == pytest.approx(rs + ag + ar)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stage_pipeline_bubble(schedule):
    # Forward 1 s, backward 2 s on each stage, 4 micro-batches: the first rank ends after (n + p - 1)(f + b)
    # and idles (p - 1)(f + b) of it. With a send of 0.25 s between the stages, worked through by hand: GPipe's
    # critical path crosses twice (the first forward, the last backward), 15.5 s; 1F1B's waits for a backward
    # from the next stage in every cycle, 16 s.
    f, b, n, p = 1.0, 2.0, 4, 2
    order = single_stage_order(schedule, p, n)
    played = play_schedule(order, p, lambda kind, stage: ({"F": f, "B": b}[kind], 0.0), lambda a, c: 0.0)
    assert played.end[0] == pytest.approx((n + p - 1) * (f + b))
    assert played.bubble(0) == pytest.approx((p - 1) * (f + b))
    assert played.busy[1] == pytest.approx(n * (f + b))
    sent = play_schedule(order, p, lambda kind, stage: ({"F": f, "B": b}[kind], 0.0), lambda a, c: 0.25)
    assert sent.end[0] == pytest.approx({"gpipe": 15.5, "1f1b": 16.0}[schedule])


def test_one_f_one_b_with_a_slower_last_stage():
    # Four stages, the last one slower (it holds the head and the loss): forward 1 s and backward 2 s on the
    # first three, 1.5 s and 2.5 s on the last, 8 micro-batches. Worked by hand: the last stage never waits once
    # its first input is there (its upstream hands it the next forward before it needs it), so it ends at
    # (p-1) f + n (f_L + b_L) and the last backward walks back through the p-1 others: rank 0 ends at
    # (p-1)(f + b) + n (f_L + b_L) = 9 + 32 = 41 s, idle 17 s of it: the textbook (p-1)(f+b) = 9 s plus the
    # slower stage's surplus for every micro-batch, n (f_L + b_L - f - b) = 8 s. (benchmarks/results/predict.md,
    # "Anomalies": frontier-175b's replayed bubble, 9.0 s against 5.9 s, is this.)
    f, b, f_last, b_last, n, p = 1.0, 2.0, 1.5, 2.5, 8, 4
    order = single_stage_order("1f1b", p, n)

    def cost(kind, stage):
        last = stage == p - 1
        return ({"F": f_last if last else f, "B": b_last if last else b}[kind], 0.0)

    played = play_schedule(order, p, cost, lambda a, c: 0.0)
    assert played.end[0] == pytest.approx((p - 1) * (f + b) + n * (f_last + b_last))
    assert played.bubble(0) == pytest.approx((p - 1) * (f + b) + n * (f_last + b_last - f - b))
    assert played.end[p - 1] == pytest.approx((p - 1) * f + n * (f_last + b_last))


def test_one_f_one_b_order():
    # torch's Schedule1F1B: the first of two ranks runs two forwards before its first backward, the last one.
    order = single_stage_order("1f1b", 2, 3)
    assert order[0] == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2)]
    assert order[1] == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2)]


def test_gradient_reductions_after_the_last_backward_extend_the_rank():
    # Each backward issues 1.5 s of async reductions on the rank's channel: the last one's run past the end.
    order = single_stage_order("gpipe", 1, 2)
    played = play_schedule(order, 1, lambda kind, stage: (1.0, 1.5 if kind == "B" else 0.0), lambda a, c: 0.0)
    # F F B B end at 4 s; the channel starts the first at 2 s, the second at 3.5 s: done at 5 s.
    assert played.end[0] == pytest.approx(5.0)
    assert played.comm_tail[0] == pytest.approx(1.0)


def test_every_collective_pays_the_wake_up_where_ranks_share_the_cores():
    # A CPU machine whose ranks wake each other (sync_cost) pays it on every collective of two or more ranks.
    pair = {"op": "all_reduce", "ranks": [0, 1], "bytes": 10**9}
    alone = {"op": "all_reduce", "ranks": [0], "bytes": 10**9}
    assert collective_time(machine(sync_cost=1e-3), pair, 0) == pytest.approx(1e9 / (100 * GB) + 2 * 1e-6 + 1e-3)
    assert collective_time(machine(sync_cost=1e-3), alone, 0) == 0.0


def test_sync_fit_recovers_the_wake_up_and_the_variability():
    # Meetings after 5 and 30 ms of work on 2 ranks, built from a 0.3 ms aligned barrier, a 1 ms wake-up and a
    # 5% variability: the slowest of two arrives s x 0.05 x E[max of 2 normals] = s x 0.05 / sqrt(pi) late.
    late = 0.05 / math.sqrt(math.pi)
    stretches = [(s, 0.3e-3 + 1e-3 + s * late) for s in (0.005, 0.03)]
    sync_cost, cv = fit_sync(stretches, 0.3e-3, 2)
    assert sync_cost == pytest.approx(1e-3) and cv == pytest.approx(0.05, rel=1e-4)
    # A noisy measurement never gives a negative cost or variability.
    assert fit_sync([(0.005, 0.2e-3), (0.03, 0.1e-3)], 0.3e-3, 2) == (0.0, 0.0)
