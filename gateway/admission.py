"""Bounded admission: at most `limit()` requests outstanding at the workers, `max_queue` more
waiting here in FIFO order, and an immediate QueueFull beyond that (the route answers 429 at
once, whatever the engine is doing).

    acquire() ──slot free──▶ Slot (outstanding += 1)
              ──queue has room──▶ wait (FIFO) ──a Slot is released──▶ Slot
              ──queue full──▶ QueueFull, without waiting
    Slot.release() is idempotent, so every exit path of a request may call it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class QueueFull(Exception):
    """The gateway's queue is full: answer 429."""


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

    async def acquire(self) -> Slot:
        if self.outstanding < max(1, self._limit()) and not self._waiters:
            self.outstanding += 1
            return Slot(self)
        if len(self._waiters) >= self.max_queue:
            raise QueueFull(f"{self.outstanding} requests running and {len(self._waiters)} "
                            "queued: the gateway is at capacity")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future  # resolved by _release, which has already counted us as outstanding
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # we were handed a slot but nobody will use it
            else:
                self._waiters.remove(future)
            raise
        return Slot(self)

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
