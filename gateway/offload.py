"""Blocking work the event loop hands off: one place, a bounded pool per kind of work.

    kind       threads  waiting    per client  running per key  what
    tokenize   3        admission  -           2 (a model)      tokenizing, chat templates
                                                                (intake; each job holds a ticket)
    grammar    1        8          2           -                compiling a structured-output
                                                                grammar (structured; a schema
                                                                compiles once: grammar_cache)
    hello      1        4          -           -                vetting a worker's Hello (hello)

`await run(kind, fn, *args, client=c, key=k)` runs `fn(*args)` on that kind's threads. A job past
its kind's room (running + waiting), or past a client's share of an expensive kind, is refused at
once with Busy (a 429 for a request; a Hello is asked again later), so a flood of one kind never
waits in front of another, and one client cannot fill a kind for the rest. Each kind has its own
threads, so a grammar flood leaves tokenizing free and a slow Hello delays no request. Within a
kind, the jobs of one key (a model: its chat template may be slow, up to --template-timeout-s a
render) run on at most `per_key` threads at once, so another model's jobs always find a thread;
a job held back for its key waits in order, it is not refused.

The threads are daemons: a job that cannot be interrupted (native code) never keeps the process
from exiting on SIGTERM. Python jobs that may run long bound themselves (the chat template's
render stops at its deadline: gateway/tokens/tokenizer.py). `LoopLag` samples how late the event
loop wakes, the figure that says whether anything still blocks it (kestrel_event_loop_lag_seconds).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
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
class Shares:
    """What each client holds of something limited to `per_client` at once (0: no limit);
    a client that holds nothing is forgotten, so the map stays as small as the clients using it."""

    per_client: int
    held: dict[str, int] = field(default_factory=dict)

    def take(self, client: str | None) -> bool:
        """One more for `client` (None: nobody's, never limited); False when it has its share."""
        if not self.per_client or client is None:
            return True
        n = self.held.get(client, 0)
        if n >= self.per_client:
            return False
        self.held[client] = n + 1
        return True

    def give(self, client: str | None) -> None:
        if not self.per_client or client is None:
            return
        left = self.held.pop(client, 1) - 1
        if left > 0:
            self.held[client] = left


@dataclass
class Pool:
    kind: str
    threads: int
    waiting: int
    per_client: int = 0  # 0: no per-client share
    per_key: int = 0  # 0: any number of threads for one key's jobs
    busy: int = 0  # running + waiting
    _queue: deque[tuple[Any, ...]] = field(default_factory=deque)  # guarded by _cond
    _running: dict[str, int] = field(default_factory=dict)  # key -> jobs running; by _cond
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _started: bool = False

    def __post_init__(self) -> None:
        self._shares = Shares(self.per_client)

    @property
    def by_client(self) -> dict[str, int]:
        return self._shares.held

    def _start(self) -> None:
        for i in range(self.threads):
            threading.Thread(target=self._serve, name=f"{self.kind}-{i}", daemon=True).start()
        self._started = True

    def _next(self) -> tuple[Any, ...] | None:
        """The oldest job whose key may have another thread now (call under _cond)."""
        for i, job in enumerate(self._queue):
            key = job[4]
            if key is None or not self.per_key or self._running.get(key, 0) < self.per_key:
                del self._queue[i]
                if key is not None:
                    self._running[key] = self._running.get(key, 0) + 1
                return job
        return None

    def _serve(self) -> None:
        while True:
            with self._cond:
                while (job := self._next()) is None:
                    self._cond.wait()
            loop, fut, fn, args, key = job
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting coroutine, never lost here
                result, error = None, exc
            if key is not None:
                with self._cond:
                    left = self._running.pop(key, 1) - 1
                    if left > 0:
                        self._running[key] = left
                    self._cond.notify()  # a job held back for this key may run on another thread
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # that loop has closed (a test's, or the server's at exit)
                pass
            del job, loop, fut, fn, args, result, error  # none of it kept while this thread waits

    async def run(self, fn: Callable[..., T], *args: Any, client: str | None = None,
                  key: str | None = None) -> T:
        if self.busy >= self.threads + self.waiting:
            raise Busy(self.kind, per_client=False)
        if not self._shares.take(client):
            raise Busy(self.kind, per_client=True)
        if not self._started:
            self._start()
        self.busy += 1
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        fut.add_done_callback(lambda f: self._done(f, client))
        with self._cond:
            self._queue.append((loop, fut, fn, args, key))
            self._cond.notify()
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
        self._shares.give(client)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


POOLS: dict[str, Pool] = {
    # every tokenizing job holds an admission ticket: admission bounds it (a room of its own
    # refused half of a 128-request burst that admission had room for)
    "tokenize": Pool("tokenize", threads=3, waiting=1 << 16, per_key=2),
    "grammar": Pool("grammar", threads=1, waiting=8, per_client=2),
    "hello": Pool("hello", threads=1, waiting=4),
}


async def run(kind: str, fn: Callable[..., T], *args: Any, client: str | None = None,
              key: str | None = None) -> T:
    return await POOLS[kind].run(fn, *args, client=client, key=key)


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
