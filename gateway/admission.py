"""Admission: at most `limit()` requests outstanding at the workers, and a FIFO queue in front of
them that takes a request only if it can expect to start (and finish) before its deadline.

    reserve(budget) ──a slot is free, nobody waits──▶ Ticket, granted (outstanding += 1)
                    ──the queue is at max_queue──▶ QueueFull (429), at once
                    ──expected wait + service > budget──▶ WouldMissDeadline (429), at once
                    ──otherwise──▶ Ticket, waiting in FIFO order
    Ticket.wait(timeout) ──a Slot is released──▶ Slot ──timeout passes──▶ TimeoutError
    Ticket.cancel() / Slot.release() are idempotent, so every exit path may call them.

The decision is synchronous and costs O(1) (plus one pass over the ready workers): no await, no
thread, nothing that grows with the number of connections. Expected wait = (requests queued ahead
+ 1) / the workers' measured drain rate (gateway.drain.DrainEstimator); service = how long a slot
is typically held. Before any rate is measured (a cold start), the queue holds at most
`cold_queue()` requests (the gateway passes `limit()`: one round of slots). `max_queue` stays the
hard cap. Retry-After comes from the same estimate: the time for the queue to drain to where this
request would have fitted.

The timeout is a timer on the waiter's own future, not asyncio.wait_for: before Python 3.12,
wait_for can swallow a cancellation that arrives as the slot is granted, and the caller (whose
client has gone) would go on to use a slot nobody releases.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from gateway.drain import DrainEstimator


class Rejected(Exception):
    """Not admitted: answer 429 with Retry-After `retry_after` seconds."""

    reason = "rejected"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFull(Rejected):
    """The gateway's queue is at its cap."""

    reason = "queue_full"


class WouldMissDeadline(Rejected):
    """The queue drains too slowly for this request to finish inside its deadline."""

    reason = "would_miss_deadline"


class QueueClosed(Exception):
    """The gateway stopped admitting (it is shutting down) while this request waited."""


class Slot:
    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.released = False
        self.granted_at = time.monotonic()
        self.worker: str | None = None  # set once a worker took the request: it drains the queue

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._release(self)


class Ticket:
    """A place in the queue (or a slot granted at once)."""

    def __init__(self, admission: Admission, slot: Slot | None) -> None:
        self._admission = admission
        self.slot = slot
        self.future: asyncio.Future[Slot] | None = None
        self.cancelled = False

    @property
    def granted(self) -> bool:
        return self.slot is not None

    async def wait(self, timeout: float | None = None) -> Slot:
        """The slot, once granted; TimeoutError after `timeout` s; QueueClosed on shutdown."""
        if self.slot is not None:
            return self.slot
        assert self.future is not None
        loop = asyncio.get_running_loop()
        timer = None if timeout is None else loop.call_later(max(0.0, timeout),
                                                             self._admission._expire, self)
        try:
            self.slot = await self.future  # set by _wake, which counted us as outstanding
        except asyncio.CancelledError:
            self.cancel()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return self.slot

    def cancel(self) -> None:
        """Give the place (or the slot, if it was granted meanwhile) back. Idempotent."""
        if self.cancelled:
            return
        self.cancelled = True
        future = self.future
        if future is not None and future.done() and not future.cancelled() \
                and future.exception() is None and self.slot is None:
            self.slot = future.result()  # granted, but nobody will use it
        if self.slot is not None:
            self.slot.release()
        else:
            self._admission._forget(self)
            if future is not None and not future.done():
                future.cancel()


class Admission:
    def __init__(self, limit: Callable[[], int], max_queue: int,
                 estimator: DrainEstimator | None = None,
                 workers: Callable[[], Iterable[str]] = lambda: (),
                 cold_queue: Callable[[], int] | None = None) -> None:
        self._limit = limit  # read each time: the default follows the workers that are ready
        self.max_queue = max_queue
        self.estimator = estimator or DrainEstimator()
        self._workers = workers  # ids of the workers ready now (their drain rates add up)
        # Most waiters before any drain rate is measured (None: max_queue).
        self._cold_queue = cold_queue
        self.outstanding = 0
        self._waiters: OrderedDict[Ticket, None] = OrderedDict()  # FIFO, O(1) removal

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def queue_full(self) -> bool:
        return self.waiting >= self.max_queue and self.outstanding >= self.limit

    @property
    def limit(self) -> int:
        return max(1, self._limit())

    def drain_rate(self) -> float:
        """Slots the workers free per second lately (0.0: not measured yet)."""
        return self.estimator.rate(self._workers())

    def expected_wait(self, ahead: int | None = None) -> float | None:
        """Seconds a request arriving now (behind `ahead` waiters, default all) would wait for
        a slot; None when no drain rate is measured yet."""
        ahead = self.waiting if ahead is None else ahead
        if ahead == 0 and self.outstanding < self.limit:
            return 0.0
        rate = self.drain_rate()
        return (ahead + 1) / rate if rate > 0 else None

    def check(self, budget: float | None = None) -> bool:
        """Whether a request with `budget` seconds left would get a slot at once (True) or a
        place in the queue (False); Rejected when it would get neither. Changes nothing."""
        if self.outstanding < self.limit and not self._waiters:
            return True
        ahead = len(self._waiters)
        rate = self.drain_rate()
        if ahead >= self.max_queue:
            over = ahead - self.max_queue + 1
            raise QueueFull(f"{self.outstanding} requests running and {ahead} queued: the "
                            "gateway is at capacity", over / rate if rate > 0 else 1.0)
        if rate <= 0:
            if self._cold_queue is not None and ahead >= max(1, self._cold_queue()):
                raise QueueFull(f"{self.outstanding} requests running and {ahead} queued, and "
                                "no drain rate measured yet", 1.0)
        elif budget is not None:
            wait, service = (ahead + 1) / rate, self.estimator.service_s()
            if wait + service > budget:
                # It would have fitted behind `fits` waiters: retry once the rest have drained.
                fits = max(0, math.floor((budget - service) * rate) - 1)
                raise WouldMissDeadline(
                    f"the queue ahead ({ahead}) drains at {rate:.2f}/s: an expected wait of "
                    f"{wait:.1f} s and {service:.1f} s to run do not fit in the deadline "
                    f"({budget:.1f} s)", (ahead - fits) / rate)
        return False

    def reserve(self, budget: float | None = None) -> Ticket:
        """A place for a request that has `budget` seconds left, or Rejected at once."""
        if self.check(budget):
            self.outstanding += 1
            return Ticket(self, Slot(self))
        ticket = Ticket(self, None)
        ticket.future = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = None
        return ticket

    async def acquire(self, timeout: float | None = None) -> Slot:
        """A slot now, or after waiting in FIFO order for at most `timeout` seconds (then
        TimeoutError); Rejected at once when the queue cannot take it."""
        return await self.reserve(timeout).wait(timeout)

    def reject_waiters(self) -> None:
        """Shutting down: every request still waiting gets QueueClosed now."""
        while self._waiters:
            ticket, _ = self._waiters.popitem(last=False)
            if ticket.future is not None and not ticket.future.done():
                ticket.future.set_exception(QueueClosed("the server is shutting down"))

    def _expire(self, ticket: Ticket) -> None:
        if ticket.future is not None and not ticket.future.done():
            self._forget(ticket)
            ticket.future.set_exception(TimeoutError("no slot was free in time"))

    def _forget(self, ticket: Ticket) -> None:
        self._waiters.pop(ticket, None)

    def _release(self, slot: Slot) -> None:
        self.outstanding -= 1
        if slot.worker is not None:
            self.estimator.record(slot.worker, time.monotonic() - slot.granted_at)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.outstanding < self.limit:
            ticket, _ = self._waiters.popitem(last=False)
            if ticket.future is not None and not ticket.future.done():
                self.outstanding += 1
                ticket.future.set_result(Slot(self))

    def poke(self) -> None:
        """The limit may have grown (a worker joined): admit waiters that now fit."""
        self._wake()
