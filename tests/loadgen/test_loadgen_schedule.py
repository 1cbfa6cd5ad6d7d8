"""loadgen/schedule.py: the Poisson schedule, checked statistically from the schedule itself."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.schedule import gaps, poisson_schedule


def ks_exponential(sample: list[float], rate: float) -> float:
    """Kolmogorov-Smirnov statistic of `sample` against the Exponential(rate) CDF."""
    xs = sorted(sample)
    n = len(xs)
    d = 0.0
    for i, x in enumerate(xs, 1):
        cdf = 1.0 - math.exp(-rate * x)
        d = max(d, i / n - cdf, cdf - (i - 1) / n)
    return d


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_gaps_are_exponential_with_mean_one_over_rate(rate: float, seed: int) -> None:
    n = 1000
    schedule = poisson_schedule(rate, num_requests=n, seed=seed)
    g = gaps(schedule)
    assert len(schedule) == n
    mean = sum(g) / n
    assert abs(mean - 1 / rate) < 0.1 / rate
    critical = 1.63 / math.sqrt(n)  # the 1% level
    assert ks_exponential(g, rate) < critical


def test_ks_check_rejects_gaps_that_are_not_exponential() -> None:
    # The check above can fail: evenly spaced arrivals at the same mean rate do not pass it.
    rate, n = 4.0, 1000
    even = [(i + 1) / rate for i in range(n)]
    assert ks_exponential(gaps(even), rate) > 1.63 / math.sqrt(n)
    # Nor does a Poisson schedule at the wrong rate.
    assert ks_exponential(gaps(poisson_schedule(2 * rate, num_requests=n)), rate) > 0.1


def test_same_seed_same_schedule_different_seed_different() -> None:
    a = poisson_schedule(3.0, num_requests=500, seed=7)
    assert a == poisson_schedule(3.0, num_requests=500, seed=7)
    assert a != poisson_schedule(3.0, num_requests=500, seed=8)


def test_duration_bounds_the_schedule() -> None:
    s = poisson_schedule(10.0, duration_s=20.0, seed=0)
    assert s and s[-1] <= 20.0
    assert abs(len(s) - 200) < 200 * 0.2  # about rate * duration
    both = poisson_schedule(10.0, duration_s=20.0, num_requests=50, seed=0)
    assert both == s[:50]


def test_infinite_rate_is_a_burst_and_bad_arguments_fail() -> None:
    assert poisson_schedule(math.inf, num_requests=5) == [0.0] * 5
    with pytest.raises(ValueError):
        poisson_schedule(0.0, num_requests=5)
    with pytest.raises(ValueError):
        poisson_schedule(1.0)
    with pytest.raises(ValueError):
        poisson_schedule(math.inf, duration_s=1.0)


@settings(max_examples=40, deadline=None)
@given(rate=st.floats(0.01, 1000), n=st.integers(1, 200), seed=st.integers(0, 2**32))
def test_schedule_is_increasing_and_positive(rate: float, n: int, seed: int) -> None:
    s = poisson_schedule(rate, num_requests=n, seed=seed)
    assert len(s) == n
    assert s == sorted(s) and s[0] >= 0
