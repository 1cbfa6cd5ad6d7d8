"""Admission: at most `limit()` requests outstanding at the workers, and a FIFO queue in front of
them that takes a request with a deadline only if it can finish before it.

    reserve(work) ──a slot is free, nobody waits──▶ Ticket, granted (outstanding += 1)
                  ──the queue is at max_queue──▶ QueueFull (429), at once
                  ──a deadline it would miss behind the backlog──▶ WouldMissDeadline (429), at once
                  ──otherwise──▶ Ticket, waiting in FIFO order
    Ticket.wait(timeout) ──a Slot is released──▶ Slot ──timeout passes──▶ TimeoutError
    Ticket.cancel() / Slot.release() are idempotent, so every exit path may call them.

Each admitted request is a Work in the Backlog from its reservation until its slot (or ticket) is
given back: whether a deadline can be met is decided against everything admitted before it, a
burst still being tokenized included, from the costs the workers measured
(gateway.admission.backlog). A request without a deadline is never refused on an estimate: it waits
in the bounded queue. Every worker reports its costs in its Hello; a model none reports for is not
estimated (its requests' deadlines still bound them). Retry-After comes from the drain rate of the
workers (gateway.admission.drain.DrainEstimator) or the estimate's overshoot.

The timeout is a timer on the waiter's own future, not asyncio.wait_for: before Python 3.12,
wait_for can swallow a cancellation that arrives as the slot is granted, and the caller (whose
client has gone) would go on to use a slot nobody releases.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from gateway.admission.backlog import Backlog, Capacity, Decision, Work
from gateway.admission.drain import DrainEstimator


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
    """Behind the work admitted before it, this request would not finish inside its deadline."""

    reason = "would_miss_deadline"


class QueueClosed(Exception):
    """The gateway stopped admitting (it is shutting down) while this request waited."""


@dataclass(frozen=True)
class Served:
    """The event a slot is released with once a worker ran its request: how fast that worker
    drains the queue is learned from it (DrainEstimator.record)."""

    worker: str  # the worker that ended it (a retry may have moved it)
    ran: float = 1.0  # the share of what it asked for that ran (less: its client left early)


class Slot:
    def __init__(self, admission: Admission, work: Work | None = None) -> None:
        self._admission = admission
        self.work = work  # what the backlog counts for it until it is released
        self.released = False
        self.granted_at = time.monotonic()

    def release(self, served: Served | None = None) -> None:
        """Give the slot back (idempotent); `served` when a worker ran its request."""
        if not self.released:
            self.released = True
            self._admission._release(self, served)


class Ticket:
    """A place in the queue (or a slot granted at once)."""

    def __init__(self, admission: Admission, slot: Slot | None, work: Work | None = None) -> None:
        self._admission = admission
        self.slot = slot
        self.work = work
        self.future: asyncio.Future[Slot] | None = None
        self.cancelled = False

    @property
    def granted(self) -> bool:
        return self.slot is not None

    @property
    def admission(self) -> Admission:
        """The (model's) admission this place is in."""
        return self._admission

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
                 capacity: Callable[[str], Capacity | None] = lambda _model: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limit = limit  # read each time: the default follows the workers that are ready
        self.max_queue = max_queue
        self.estimator = estimator or DrainEstimator()
        self._workers = workers  # ids of the workers ready now (their drain rates add up)
        self.backlog = Backlog(capacity, clock)
        self.clock = clock
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

    def check(self, work: Work | None = None) -> bool:
        """Whether `work` would get a slot at once (True) or a place in the queue (False);
        Rejected when it would get neither. Changes nothing. Without `work` (before a body is
        read), only whether the queue has room."""
        return self._check(work)[0]

    def _check(self, work: Work | None) -> tuple[bool, Decision | None]:
        free = self.outstanding < self.limit and not self._waiters
        ahead = len(self._waiters)
        if not free and ahead >= self.max_queue:
            rate = self.drain_rate()
            over = ahead - self.max_queue + 1
            raise QueueFull(f"{self.outstanding} requests running and {ahead} queued: the "
                            "gateway is at capacity", over / rate if rate > 0 else 1.0)
        decision = None if work is None else self.backlog.decide(work)
        if work is not None and work.deadline is not None:
            self._check_deadline(work, decision, free)
        return free, decision

    def refine(self, work: Work, free: bool) -> None:
        """`work` (already counted) has changed (its prompt tokenized): decide again; for a
        deadline, WouldMissDeadline now if it no longer fits."""
        decision = self.backlog.decide(work)
        if work.deadline is not None:
            self._check_deadline(work, decision, free)
        self.backlog.commit(work, decision)

    def _check_deadline(self, work: Work, decision: Decision | None, free: bool) -> None:
        """WouldMissDeadline unless `work` can finish by its deadline behind the backlog, and
        without making a request admitted before it miss its own."""
        assert work.deadline is not None
        budget = work.deadline - self.clock()
        if decision is None:  # no ready worker of its model, or none that reports its costs:
            return  # nothing to decide with (start() answers 503; its deadline still bounds it)
        if decision.finish_s > budget:
            alone = self.backlog.idle_s(replace(work, prompt_tokens=0))
            if alone is not None and alone > budget:
                return  # not even alone and idle: a 400 once tokenized (Admitter.check_fit)
            raise WouldMissDeadline(
                f"behind the {len(self.backlog.ahead_of(work))} requests admitted before it, "
                f"this one would take about {decision.finish_s:.1f} s, past its deadline "
                f"({budget:.1f} s left)", max(1.0, decision.finish_s - budget))
        if decision.short_by > 0:
            raise WouldMissDeadline(
                "admitting this request now would make one admitted before it miss its "
                f"deadline by about {decision.short_by:.1f} s", max(1.0, decision.short_by))

    def reserve(self, work: Work | None = None) -> Ticket:
        """A place for `work`, or Rejected at once. It counts in the backlog from now until its
        slot or ticket is given back."""
        free, decision = self._check(work)
        if free:
            self.outstanding += 1
            ticket = Ticket(self, Slot(self, work), work)
        else:
            ticket = Ticket(self, None, work)
            ticket.future = asyncio.get_running_loop().create_future()
            self._waiters[ticket] = None
        if work is not None:
            self.backlog.add(work)
            self.backlog.commit(work, decision)
        return ticket

    async def acquire(self, timeout: float | None = None) -> Slot:
        """A slot now, or after waiting in FIFO order for at most `timeout` seconds (then
        TimeoutError); Rejected at once when the queue cannot take it."""
        return await self.reserve().wait(timeout)

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
        if ticket.work is not None:
            self.backlog.remove(ticket.work)

    def _release(self, slot: Slot, served: Served | None) -> None:
        self.outstanding -= 1
        self._wake()  # (it reads neither the backlog nor the estimate)
        if slot.work is not None:
            self.backlog.remove(slot.work)
        if served is not None:
            self.estimator.record(served.worker, time.monotonic() - slot.granted_at, served.ran)

    def _wake(self) -> None:
        while self._waiters and self.outstanding < self.limit:
            ticket, _ = self._waiters.popitem(last=False)
            if ticket.future is not None and not ticket.future.done():
                self.outstanding += 1
                ticket.future.set_result(Slot(self, ticket.work))
            elif ticket.work is not None:
                self.backlog.remove(ticket.work)

    def poke(self) -> None:
        """The limit may have grown (a worker joined): admit waiters that now fit."""
        self._wake()


class Admissions:
    """One Admission per model: each with its own limit (the seats of that model's ready
    workers), queue (max_queue each) and backlog, so that a model's load never fills another's
    seats, and a worker of one model announcing many sequences lifts no other model's limit.
    The totals are for the gauges and /health."""

    def __init__(self, limit: Callable[[str], int], max_queue: int,
                 workers: Callable[[str], Iterable[str]],
                 capacity: Callable[[str], Capacity | None]) -> None:
        self._limit, self._workers, self._capacity = limit, workers, capacity
        self.max_queue = max_queue
        self.by_model: dict[str, Admission] = {}

    def of(self, model: str) -> Admission:
        """The model's admission ("" for a name no worker serves: the route answers 404)."""
        admission = self.by_model.get(model)
        if admission is None:
            # Its own drain estimate: a rate() forgets the workers it is not given.
            admission = self.by_model[model] = Admission(
                lambda: self._limit(model), self.max_queue, DrainEstimator(),
                workers=lambda: self._workers(model), capacity=self._capacity)
        return admission

    @property
    def outstanding(self) -> int:
        return sum(a.outstanding for a in self.by_model.values())

    @property
    def waiting(self) -> int:
        return sum(a.waiting for a in self.by_model.values())

    @property
    def queue_full(self) -> bool:
        """Every model's queue is full (before a body names its model, nothing else is known)."""
        return bool(self.by_model) and all(a.queue_full for a in self.by_model.values())

    def check(self) -> None:
        """Before the body is read: QueueFull only when no model could take the request."""
        if self.queue_full:
            for admission in self.by_model.values():
                admission.check()

    def drain_rate(self) -> float:
        return sum(a.drain_rate() for a in self.by_model.values())

    def service_s(self) -> float:
        """The longest of the models' slot hold times lately."""
        return max((a.estimator.service_s() for a in self.by_model.values()), default=0.0)

    def expected_wait(self) -> float | None:
        """The longest of the models' expected waits (None: one is not measured yet)."""
        waits = [a.expected_wait() for a in self.by_model.values()]
        if any(w is None for w in waits):
            return None
        return max(waits, default=0.0)  # type: ignore[type-var]

    def reject_waiters(self) -> None:
        for admission in self.by_model.values():
            admission.reject_waiters()

    def poke(self) -> None:
        for admission in self.by_model.values():
            admission.poke()
