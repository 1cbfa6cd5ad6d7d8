"""Blocking work the event loop hands off: one place, a bounded pool per kind of work.

    kind       threads  waiting  per client  what
    tokenize   2        64       -           tokenizing, chat templates (gateway/intake.py)
    grammar    1        8        2           compiling a structured-output grammar (structured;
                                             a schema compiles once: gateway/grammar_cache.py)
    hello      1        4        -           vetting a worker's Hello: its tokenizer (hello)

`await run(kind, fn, *args, client=key)` runs `fn(*args)` on that kind's threads. A job past its
kind's room (running + waiting), or past a client's share of an expensive kind, is refused at
once with Busy (a 429 for a request; a Hello is asked again later), so a flood of one kind never
waits in front of another, and one client cannot fill a kind for the rest. Each kind has its own
threads, so a grammar flood leaves tokenizing free and a slow Hello delays no request.

The threads are daemons: a job that cannot be interrupted (native code) never keeps the process
from exiting on SIGTERM. Python jobs that may run long bound themselves (the chat template's
render stops at its deadline: gateway/tokenizer.py). `LoopLag` samples how late the event loop
wakes, the figure that says whether anything still blocks it (kestrel_event_loop_lag_seconds).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


class Busy(Exception):
    """A kind of work is full (for everyone, or for this client)."""

    def __init__(self, kind: str, per_client: bool) -> None:
        who = "from this client " if per_client else ""
        super().__init__(f"too many {kind} jobs {who}at once; retry shortly")
        self.kind = kind
        self.per_client = per_client


@dataclass
class Pool:
    kind: str
    threads: int
    waiting: int
    per_client: int = 0  # 0: no per-client share
    busy: int = 0  # running + waiting
    by_client: dict[str, int] = field(default_factory=dict)
    _jobs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _started: bool = False

    def _start(self) -> None:
        for i in range(self.threads):
            threading.Thread(target=self._serve, name=f"{self.kind}-{i}", daemon=True).start()
        self._started = True

    def _serve(self) -> None:
        while True:
            loop, fut, fn, args = self._jobs.get()
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting coroutine, never lost here
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # that loop has closed (a test's, or the server's at exit)
                pass

    async def run(self, fn: Callable[..., T], *args: Any, client: str | None = None) -> T:
        if self.busy >= self.threads + self.waiting:
            raise Busy(self.kind, per_client=False)
        if self.per_client and client is not None:
            if self.by_client.get(client, 0) >= self.per_client:
                raise Busy(self.kind, per_client=True)
            self.by_client[client] = self.by_client.get(client, 0) + 1
        if not self._started:
            self._start()
        self.busy += 1
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        fut.add_done_callback(lambda f: self._done(f, client))
        self._jobs.put((loop, fut, fn, args))
        # Shielded: a caller that gives up (its client left) does not free the place of a job
        # that still runs; the place is freed when the job ends.
        return await asyncio.shield(fut)

    def _done(self, fut: asyncio.Future, client: str | None) -> None:
        if not fut.cancelled():
            # Read here: when the caller gave up (its client left), asyncio.shield drops its
            # own callback on the job, and an error the job ends with would be logged at ERROR
            # with a traceback as "Future exception was never retrieved".
            fut.exception()
        self.busy -= 1
        if self.per_client and client is not None:
            left = self.by_client.pop(client, 1) - 1
            if left > 0:
                self.by_client[client] = left


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


POOLS: dict[str, Pool] = {
    "tokenize": Pool("tokenize", threads=2, waiting=64),
    "grammar": Pool("grammar", threads=1, waiting=8, per_client=2),
    "hello": Pool("hello", threads=1, waiting=4),
}


async def run(kind: str, fn: Callable[..., T], *args: Any, client: str | None = None) -> T:
    return await POOLS[kind].run(fn, *args, client=client)


class LoopLag:
    """Samples the event loop's lateness: a timer due every `period` s, observed late by how
    long the loop was busy with something else."""

    def __init__(self, observe: Callable[[float], None], period: float = 0.1) -> None:
        self.observe = observe
        self.period = period
        self.worst = 0.0

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.period
            await asyncio.sleep(self.period)
            lag = max(0.0, loop.time() - due)
            self.worst = max(self.worst, lag)
            self.observe(lag)
