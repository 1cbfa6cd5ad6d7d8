"""Bounded admission: at most `limit()` requests outstanding at the workers, `max_queue` more
waiting here in FIFO order, and an immediate QueueFull beyond that (the route answers 429 at
once, whatever the engine is doing).

    acquire() ──slot free──▶ Slot (outstanding += 1)
              ──queue has room──▶ wait (FIFO) ──a Slot is released──▶ Slot
                                              ──timeout passes──▶ TimeoutError
              ──queue full──▶ QueueFull, without waiting
    Slot.release() is idempotent, so every exit path of a request may call it.

The timeout is a timer on the waiter's own future, not asyncio.wait_for: before Python 3.12,
wait_for can swallow a cancellation that arrives as the slot is granted, and the caller (whose
client has gone) would go on to use a slot nobody releases.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class QueueFull(Exception):
    """The gateway's queue is full: answer 429."""


class QueueClosed(Exception):
    """The gateway stopped admitting (it is shutting down) while this request waited."""


class Slot:
    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._release()


class Admission:
    def __init__(self, limit: Callable[[], int], max_queue: int) -> None:
        self._limit = limit  # read each time: the default follows the workers that are ready
        self.max_queue = max_queue
        self.outstanding = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def queue_full(self) -> bool:
        return self.waiting >= self.max_queue and self.outstanding >= max(1, self._limit())

    async def acquire(self, timeout: float | None = None) -> Slot:
        """A slot now, or after waiting in FIFO order for at most `timeout` seconds (then
        TimeoutError); QueueFull at once when the queue is full."""
        if self.outstanding < max(1, self._limit()) and not self._waiters:
            self.outstanding += 1
            return Slot(self)
        if len(self._waiters) >= self.max_queue:
            raise QueueFull(f"{self.outstanding} requests running and {len(self._waiters)} "
                            "queued: the gateway is at capacity")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiters.append(future)
        timer = None if timeout is None else loop.call_later(max(0.0, timeout), self._expire,
                                                             future)
        try:
            await future  # resolved by _wake, which has already counted us as outstanding
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # we were handed a slot but nobody will use it
            else:
                self._forget(future)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return Slot(self)

    def reject_waiters(self) -> None:
        """Shutting down: every request still waiting gets QueueClosed now."""
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_exception(QueueClosed("the server is shutting down"))

    def _expire(self, future: asyncio.Future[None]) -> None:
        if not future.done():
            self._forget(future)
            future.set_exception(TimeoutError("no slot was free in time"))

    def _forget(self, future: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(future)
        except ValueError:
            pass

    def _release(self) -> None:
        self.outstanding -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.outstanding < max(1, self._limit()):
            future = self._waiters.popleft()
            if not future.done():
                self.outstanding += 1
                future.set_result(None)

    def poke(self) -> None:
        """The limit may have grown (a worker joined): admit waiters that now fit."""
        self._wake()
