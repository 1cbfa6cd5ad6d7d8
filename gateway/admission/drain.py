"""How fast the workers drain the gateway's queue: the estimate admission decides with.

    a slot held by a request a worker ran is released ──record(worker, held_s, ran)──▶
        per-worker release times and weights (a sliding window), an EWMA of how long a slot is
        held
    admission asks rate() (releases per second, summed over the workers that are ready now)
        and service_s() (seconds a request holds its slot, typically)

The rate of one worker is the releases in the last `window_s` seconds over the time since the
oldest of them (not since the newest: a worker that stops completing sees its rate fall as time
passes). A worker with no release in the window has no rate. Releases of requests that never
reached a worker (refused, or left while queued) free a slot at once and say nothing about the
workers' speed: they are not recorded. A request whose client left early is weighted by the
share of its work that ran (`ran`): a burst of streams closed after their first token once
taught 0.40 releases/s to be 2.78/s, and the next burst's deadlines were decided on it (504s).
Everything here is O(1) per release and per question
(amortized), and bounded: at most `max_events` times per worker, workers that leave are dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable


class DrainEstimator:
    def __init__(self, window_s: float = 30.0, max_events: int = 256, ewma_alpha: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0 or max_events < 1 or not 0 < ewma_alpha <= 1:
            raise ValueError("window_s and max_events must be positive, ewma_alpha in (0, 1]")
        self.window_s = window_s
        self.max_events = max_events
        self.alpha = ewma_alpha
        self.clock = clock
        # worker -> (release time, weight), oldest first
        self._events: dict[str, deque[tuple[float, float]]] = {}
        self._service: float | None = None  # EWMA of slot hold times, seconds

    def record(self, worker: str, held_s: float, ran: float = 1.0) -> None:
        """A slot a request held for `held_s` seconds at `worker` was released now, after
        `ran` of its work (1.0: it ran to its end; less: its client left first)."""
        ran = min(1.0, max(0.0, ran))
        if ran == 0.0:
            return  # nothing ran: it says nothing of the worker's speed
        times = self._events.setdefault(worker, deque(maxlen=self.max_events))
        times.append((self.clock(), ran))
        held, alpha = max(0.0, held_s), self.alpha * ran
        self._service = held if self._service is None else (
            alpha * held + (1 - alpha) * self._service)

    def worker_rate(self, worker: str) -> float:
        """Releases per second at `worker` lately; 0.0 when none in the window."""
        times = self._events.get(worker)
        if not times:
            return 0.0
        now = self.clock()
        while times and now - times[0][0] > self.window_s:
            times.popleft()
        if not times:
            return 0.0
        # Over at least one second: a burst of releases in the same instant is no sustained rate.
        return sum(weight for _, weight in times) / max(1.0, now - times[0][0])

    def rate(self, workers: Iterable[str]) -> float:
        """Releases per second summed over `workers` (those ready now); workers not listed are
        forgotten, so one that left no longer counts."""
        ready = set(workers)
        for gone in [w for w in self._events if w not in ready]:
            del self._events[gone]
        return sum(self.worker_rate(w) for w in ready)

    def service_s(self) -> float:
        """How long a request holds its slot, lately (0.0 before any was measured)."""
        return self._service or 0.0
