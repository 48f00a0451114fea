"""The forwards a pipeline rank holds at its peak (optimus.parallel.pipeline.held_forwards, which the planner's
activations are multiplied by), against torch's own action order for the interleaved schedules: the most that
order holds at once, each local stage's forwards weighted by what one keeps (under zero bubble, until its weight
backward: its input backward keeps the graph for it)."""

from __future__ import annotations

import itertools
import random

import pytest
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    _ComputationType,
)

from optimus.parallel.pipeline import held_forwards, last_stage_in_flight, zero_bubble_moments

SCHEDULES = {"interleaved_1f1b": ScheduleInterleaved1F1B, "interleaved_zb": ScheduleInterleavedZeroBubble}


def torch_order(pp: int, v: int, n_micro_batches: int, rank: int, schedule_name: str = "interleaved_1f1b") -> list:
    """Rank `rank`'s actions as torch's interleaved schedule orders them, without stages or a process group
    (its __init__ computes the order from these four attributes alone)."""
    cls = SCHEDULES[schedule_name]
    schedule = cls.__new__(cls)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, v, n_micro_batches
    schedule.number_of_rounds = max(1, n_micro_batches // pp)
    schedule.microbatches_per_round = n_micro_batches // schedule.number_of_rounds
    return [action for action in schedule._calculate_single_rank_operations(rank) if action is not None]


def heaviest_in_order(actions: list, pp: int, v: int, weights: list[float]) -> float:
    """The most weight of forwards held at once along `actions` (a forward held until its backward, or its weight
    backward where there is one)."""
    held, heaviest = [0] * v, 0.0
    for action in actions:
        local = action.stage_index // pp
        if action.computation_type == _ComputationType.FORWARD:
            held[local] += 1
            heaviest = max(heaviest, sum(n * w for n, w in zip(held, weights)))
        elif action.computation_type in (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_WEIGHT):
            held[local] -= 1
    return heaviest


CASES = [  # (pp, v, micro-batches): one round, several rounds, and torch's flexible rounds (10 over pp 4: 2 of 5)
    (2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 2, 10), (4, 3, 8), (8, 2, 8), (8, 2, 16), (8, 2, 24), (8, 4, 32),
]  # fmt: skip


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("pp,v,n_micro_batches", CASES)
def test_held_forwards_are_the_heaviest_point_of_torchs_interleaved_order(schedule, pp, v, n_micro_batches):
    draw = random.Random(pp * 100 + v * 10 + n_micro_batches)
    for rank, weights in itertools.product(range(pp), ([1.0] * v, [float(draw.randint(1, 5)) for _ in range(v)])):
        held = held_forwards(schedule, pp, v, rank, n_micro_batches, weights)
        ours = sum(n * w for n, w in zip(held, weights))
        expected = heaviest_in_order(torch_order(pp, v, n_micro_batches, rank, schedule), pp, v, weights)
        assert ours == expected, (schedule, pp, v, n_micro_batches, rank, weights, held)


def test_stages_of_unequal_size_peak_where_the_larger_is_held():
    """Rank 1 of pp 8 x v 2 with 16 micro-batches holds 21 forwards at most, but at the heaviest point 16 of its
    first stage and 5 of its second when the first is larger: with the 100B-A7B recipe's stages of 4 and 3
    layers there, 16 x 4 + 5 x 3 = 79 layers' worth, not 10.5 x 7 = 73.5."""
    assert held_forwards("interleaved_1f1b", 8, 2, 1, 16, [4, 3]) == [16, 5]
    assert sum(held_forwards("interleaved_1f1b", 8, 2, 1, 16, [1, 1])) == 21


def test_one_round_holds_every_forward_and_1f1b_holds_pp_minus_rank():
    assert held_forwards("interleaved_1f1b", 8, 2, 1, 8, [4, 3]) == [8, 8]
    assert held_forwards("1f1b", 4, 1, 1, 8, [1]) == [3]
    assert held_forwards("gpipe", 4, 1, 1, 8, [1]) == [8]


def test_zero_bubble_holds_a_forward_until_its_weight_pass():
    """pp 4 x v 2, 8 micro-batches (one round). Rank 3's order (torch's): F of stage 3 for micro-batches 0-3, then
    F, I of stage 7 in turn for 0-3, and only then the first W of stage 7: all 8 forwards held at once, where until
    the input passes it would be 5 (4 of stage 3, one of stage 7). Its last stage's forwards: 4 held (its input
    passes run first). Rank 0 runs its 8 forwards before its first input and weight pass: 8 as well."""
    assert held_forwards("interleaved_zb", 4, 2, 3, 8, [1.0, 1.0]) == [4, 4]
    assert held_forwards("interleaved_zb", 4, 2, 0, 8, [1.0, 1.0]) == [4, 4]
    assert last_stage_in_flight("interleaved_zb", 8, 4, 2) == 4
    assert last_stage_in_flight("interleaved_1f1b", 8, 4, 2) == 1


def test_zero_bubble_moments_follow_forwards_and_weight_passes():
    """pp 2 x v 2, 4 micro-batches, rank 1 (stages 1 and 3), whose order (torch's) is
    F1 F1 F3 I3 F3 I3 W3 F1 I1 W3 F1 I1 W1 F3 I3 W1 F3 I3 W3 I1 W3 I1 W1 W1. Counted by hand: during each action,
    the forwards held per stage (a weight pass's own still held) and the weight passes run (its own counted). The
    dry run of this rank (the tiny model, ZeRO-2) measured the most memory during the 17th action, the last forward
    of stage 3 (two forwards held per stage, both stages' gradient sums alive), and the 21st, stage 3's last weight
    pass (its summed gradients handed to the buckets)."""
    held = [(1, 0), (2, 0), (2, 1), (2, 1), (2, 2), (2, 2), (2, 2), (3, 1), (3, 1), (3, 1), (4, 0), (4, 0),
            (4, 0), (3, 1), (3, 1), (3, 1), (2, 2), (2, 2), (2, 2), (2, 1), (2, 1), (2, 0), (2, 0), (1, 0)]  # fmt: skip
    passes = [(0, 0)] * 6 + [(0, 1)] * 3 + [(0, 2)] * 3 + [(1, 2)] * 3 + [(2, 2)] * 3 + [(2, 3)] * 2 \
        + [(2, 4)] * 2 + [(3, 4), (4, 4)]  # fmt: skip
    # input passes run whose weight pass has not ended (an I counted from its own action, a W to the end of its own)
    awaiting = [(0, 0), (0, 0), (0, 0), (0, 1), (0, 1), (0, 2), (0, 2), (0, 1), (1, 1), (1, 1), (1, 0), (2, 0),
                (2, 0), (1, 0), (1, 1), (1, 1), (0, 1), (0, 2), (0, 2), (1, 1), (1, 1), (2, 0), (2, 0),
                (1, 0)]  # fmt: skip
    moments = zero_bubble_moments(2, 2, 1, 4)
    assert [m.held for m in moments] == held
    assert [m.weight_passes for m in moments] == passes
    assert [m.awaiting_weight for m in moments] == awaiting
