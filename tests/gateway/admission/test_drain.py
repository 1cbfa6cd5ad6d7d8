"""gateway/admission/drain.py and the admission decision built on it, against fake workers with
known rates: the estimate, the 429 for a request that would miss its deadline, its Retry-After."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.admission.backlog import Work
from gateway.admission.drain import DrainEstimator
from gateway.admission.queue import Admission, QueueFull, Served


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_worker(est: DrainEstimator, clock: FakeClock, worker: str, rate: float,
                seconds: float, held_s: float = 2.0) -> None:
    """`worker` releases a slot every 1/rate seconds for `seconds`."""
    for _ in range(int(rate * seconds)):
        clock.now += 1 / rate
        est.record(worker, held_s)


def test_the_rate_of_a_worker_with_a_known_rate() -> None:
    clock = FakeClock()
    est = DrainEstimator(window_s=30, clock=clock)
    fake_worker(est, clock, "w1", rate=4.0, seconds=10)
    assert est.rate(["w1"]) == pytest.approx(4.0, rel=0.05)
    assert est.service_s() == pytest.approx(2.0)


def test_rates_add_up_over_the_ready_workers_and_a_gone_worker_drops_out() -> None:
    clock = FakeClock()
    est = DrainEstimator(window_s=30, clock=clock)
    for _ in range(40):  # interleaved: w1 at 4/s, w2 at 2/s
        clock.now += 0.25
        est.record("w1", 1.0)
        if _ % 2:
            est.record("w2", 1.0)
    assert est.rate(["w1", "w2"]) == pytest.approx(6.0, rel=0.1)
    assert est.rate(["w1"]) == pytest.approx(4.0, rel=0.1)
    assert est.rate(["w1", "w2"]) == pytest.approx(4.0, rel=0.1)  # w2 was forgotten


def test_a_worker_that_stops_releasing_loses_its_rate() -> None:
    clock = FakeClock()
    est = DrainEstimator(window_s=10, clock=clock)
    fake_worker(est, clock, "w1", rate=5.0, seconds=10)
    before = est.rate(["w1"])
    clock.now += 5
    assert est.rate(["w1"]) < before  # over the time since the oldest release, now included
    clock.now += 11
    assert est.rate(["w1"]) == 0.0


def admission(rate: float, limit: int = 2, max_queue: int = 100,
              held_s: float = 1.0) -> tuple[Admission, FakeClock]:
    clock = FakeClock()
    est = DrainEstimator(window_s=30, clock=clock)
    fake_worker(est, clock, "w1", rate=rate, seconds=10, held_s=held_s)
    return Admission(lambda: limit, max_queue, est, workers=lambda: ["w1"]), clock


def test_expected_wait_is_the_queue_ahead_over_the_drain_rate() -> None:
    async def body() -> None:
        adm, _ = admission(rate=4.0)
        assert adm.expected_wait() == 0.0  # a slot is free
        adm.reserve()
        adm.reserve()  # both slots taken
        assert adm.expected_wait() == pytest.approx(1 / 4, rel=0.05)
        for _ in range(7):
            adm.reserve()
        assert adm.waiting == 7
        assert adm.expected_wait() == pytest.approx(8 / 4, rel=0.05)

    asyncio.run(body())


def test_the_fixed_bound_still_caps_the_queue() -> None:
    async def body() -> None:
        adm, _ = admission(rate=1000.0, max_queue=3)
        for _ in range(5):
            adm.reserve()
        with pytest.raises(QueueFull) as exc:
            adm.reserve()
        assert exc.value.reason == "queue_full" and exc.value.retry_after > 0

    asyncio.run(body())


def test_without_reported_costs_nothing_is_refused_on_an_estimate() -> None:
    """A model no worker reports step costs for is not estimated: requests with a deadline
    queue like the others, up to max_queue (their deadline still bounds them)."""
    async def body() -> None:
        adm = Admission(lambda: 2, 4, DrainEstimator(), workers=lambda: ["w1"])
        for _ in range(6):
            adm.reserve(Work("m", 10, 10, deadline=time.monotonic() + 1.0))
        assert adm.expected_wait() is None and adm.waiting == 4
        with pytest.raises(QueueFull):
            adm.reserve(Work("m", 10, 10, deadline=time.monotonic() + 1.0))

    asyncio.run(body())


def test_releases_of_requests_a_worker_ran_feed_the_estimate() -> None:
    async def body() -> None:
        adm = Admission(lambda: 1, 4, DrainEstimator(), workers=lambda: ["w1"])
        slot = await adm.acquire()
        slot.release(Served("w1"))
        unsent = await adm.acquire()  # never reached a worker: says nothing about its speed
        unsent.release()
        assert len(adm.estimator._events["w1"]) == 1

    asyncio.run(body())


def test_a_release_weighs_what_ran_and_nothing_ran_teaches_nothing() -> None:
    """Issue 42: streams closed after their first token taught a drain rate of 2.78/s where
    the worker drained 0.40/s. A release counts by the share of its work that ran."""
    clock = FakeClock()
    est = DrainEstimator(window_s=30, clock=clock)
    first = clock.now + 2.5
    fake_worker(est, clock, "w1", rate=0.4, seconds=10, held_s=5.0)  # 4 full releases
    honest = est.rate(["w1"])
    for _ in range(24):  # a burst of streams closed after 1 token of 256: 0.1 s each
        clock.now += 0.1
        est.record("w1", 0.1, ran=1 / 256)
        est.record("w1", 0.1, ran=0.0)  # (closed before any token: not counted at all)
    # Unweighted: 52 releases over 9.9 s, 5.3/s. Weighted: 4.09 releases; only time passed.
    assert est.rate(["w1"]) == pytest.approx((4 + 24 / 256) / (clock.now - first))
    assert est.rate(["w1"]) < honest
    assert est.service_s() > 4.0  # their short holds barely move the hold time either
