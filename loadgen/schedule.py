"""Arrival schedules for the open loop, computed entirely before the first request is sent.

    seed ──▶ random.Random ──▶ gamma gaps (mean 1/rate) ──▶ cumulative offsets (seconds)

Gaps are gamma-distributed with shape `burstiness` and mean 1/rate, as in `vllm bench serve`:
burstiness 1 is a Poisson process (exponential gaps, coefficient of variation 1); below 1 the
arrivals come in bursts (CV = 1/sqrt(burstiness) > 1), above 1 they are more regular (CV < 1).

The runner then launches request i at `start + offsets[i]` whatever the server is doing: an open
loop must never wait for responses, or a slow server would slow its own offered load and hide the
queueing we are trying to measure. Computing the whole schedule up front also makes it a plain
list that tests can check statistically, and the same seed gives the same list.
"""

from __future__ import annotations

import math
import random


def poisson_schedule(rate: float, *, num_requests: int | None = None,
                     duration_s: float | None = None,
                     rng: random.Random | None = None, seed: int = 0,
                     burstiness: float = 1.0) -> list[float]:
    """Offsets in seconds from the run's start of a renewal process with `rate` arrivals/s
    (Poisson for burstiness 1, whose draws are the same as before burstiness existed).

    Gaps are independent exponential draws, so the first arrival also comes after one gap (not
    at 0): every gap, including the first, has the same distribution. Stops after `num_requests`
    arrivals or before the first arrival past `duration_s`, whichever comes first. An infinite
    rate puts every arrival at 0 (a burst, like vLLM's `--request-rate inf`).
    """
    if not rate > 0:
        raise ValueError("rate must be > 0")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError("burstiness must be a finite number > 0")
    if num_requests is None and duration_s is None:
        raise ValueError("set num_requests, duration_s, or both")
    if math.isinf(rate):
        if num_requests is None:
            raise ValueError("an infinite rate needs num_requests")
        return [0.0] * num_requests
    rng = rng if rng is not None else random.Random(seed)
    offsets: list[float] = []
    t = 0.0
    while num_requests is None or len(offsets) < num_requests:
        # Shape k, scale 1/(rate k): mean 1/rate, variance 1/(rate^2 k).
        t += (rng.expovariate(rate) if burstiness == 1.0
              else rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
        if duration_s is not None and t > duration_s:
            break
        offsets.append(t)
    return offsets


def gaps(offsets: list[float]) -> list[float]:
    """Inter-arrival gaps of a schedule, the first measured from 0."""
    return [b - a for a, b in zip([0.0, *offsets[:-1]], offsets, strict=True)]


def coefficient_of_variation(values: list[float]) -> float:
    """Standard deviation over mean (population), e.g. of a schedule's gaps."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(var) / mean
