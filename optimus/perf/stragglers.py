"""A synchronous step waits for its slowest rank.

Each rank's step time varies about its mean by a fraction `cv` (machine.perf.rank_variability, a coefficient
of variation, ASSUMED unless measured: a device's clocks, the host's noise, a slow link), normally and
independently of the others'. The ranks meet at every step's collectives, so the step ends when the slowest
of them does: on average mean x (1 + cv x E[max of n standard normals]). That expectation is 0 for one rank,
0.56 for 2, 2.34 for 64, 3.55 for 3,072 and 3.90 for 12,288: the wait grows with the world and weighs on weak
scaling. The ranks meet many times a step, after each stretch of work between two collectives; taking cv as a
stretch's variation gives each meeting stretch x cv x E[max] and the step the same sum, which is how
machine=local measures it (optimus.perf.rank_sync).
"""

from __future__ import annotations

from functools import cache
from statistics import NormalDist

_NORMAL = NormalDist()


@cache
def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normals]: the integral of x n phi(x) Phi(x)^(n-1) over x (the density of
    the maximum), by the trapezoid rule on [-9, 9], where the rest weighs less than 1e-12 up to a million ranks."""
    if n <= 1:
        return 0.0
    steps, low, high = 3600, -9.0, 9.0
    width = (high - low) / steps
    total = 0.0
    for i in range(steps + 1):
        x = low + i * width
        density = n * _NORMAL.pdf(x) * _NORMAL.cdf(x) ** (n - 1)
        total += (0.5 if i in (0, steps) else 1.0) * x * density
    return total * width


def straggler_wait(step: float, cv: float, ranks: int) -> float:
    """Seconds a step of mean length `step` waits, on average, for the slowest of `ranks` ranks."""
    return step * cv * expected_max_of_normals(ranks)
