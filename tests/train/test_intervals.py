"""`every N steps`: the one rule that evaluation, the console line and checkpoints share."""

import pytest

from optimus.train.intervals import due_every


@pytest.mark.parametrize(
    "interval, last_step, expected",
    [
        (1, 7, set(range(1, 11))),
        (3, 10, {3, 6, 9, 10}),  # the run ends between two multiples: its last step counts
        (4, 8, {4, 8}),
        (5, None, {5, 10}),  # the console line: no last step of its own
        (20, 7, {7}),  # a run shorter than the interval is still evaluated once, at its end
    ],
)
def test_due_at_multiples_of_the_interval_and_at_the_last_step(interval, last_step, expected):
    assert {s for s in range(1, 11) if due_every(s, interval, last_step)} == expected


@pytest.mark.parametrize("interval", [0, -2])
def test_an_interval_of_zero_or_less_is_never_due(interval):
    # checkpoint.interval=0 turns periodic saves off, the last step included.
    assert not any(due_every(s, interval, last_step=10) for s in range(1, 11))
