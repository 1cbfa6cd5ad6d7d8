"""When one request's tokens reached the gateway: its `timings` field, its log line, the metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Timings:
    """When one request's tokens reached it (monotonic seconds), for its `timings` field, its log
    line and the metrics. A frame is timed as the route takes it from the request's queue, which
    is as it arrives unless the client reads slower than the worker writes.

    With n > 1 the choices' frames interleave, so gaps are measured within one choice: the gap
    between two choices' frames of one step is no inter-token latency.
    """

    arrival: float
    sent: float | None = None  # handed to a worker
    first_token: float | None = None  # any choice's
    last_token: float | None = None
    # The worker's time from first scheduling the request to sending its first token frame.
    since_scheduled_s: float | None = None
    gaps: list[float] = field(default_factory=list)  # within a choice, between token frames
    _first: dict[int, float] = field(default_factory=dict)  # per choice
    _last: dict[int, float] = field(default_factory=dict)
    _tokens: dict[int, int] = field(default_factory=dict)

    def on_tokens(self, index: int, count: int, now: float,
                  since_scheduled_s: float | None = None) -> None:
        if self.first_token is None:
            self.first_token = now
            self.since_scheduled_s = since_scheduled_s
        if index in self._last:
            self.gaps.append(now - self._last[index])
        else:
            self._first[index] = now
        self._last[index] = now
        self._tokens[index] = self._tokens.get(index, 0) + count
        self.last_token = now

    @property
    def queue_wait(self) -> float | None:
        """Arrival to first scheduled at a worker: time to first token less the worker's own
        first-scheduled-to-first-token time. Only the first frame's hop back is left in."""
        if self.first_token is None or self.since_scheduled_s is None:
            return None
        return max(0.0, self.first_token - self.arrival - self.since_scheduled_s)

    def tpot(self) -> float | None:
        """Seconds per output token after each choice's first: its span over its later tokens,
        pooled over the choices (for n == 1: (last - first) / (tokens - 1))."""
        later = sum(n - 1 for n in self._tokens.values())
        if later <= 0:
            return None
        return sum(self._last[i] - self._first[i] for i in self._tokens) / later

    def as_dict(self, completion_tokens: int) -> dict[str, float | None]:
        """ttft_ms: arrival to first token. tpot_ms: mean gap between later tokens.
        tokens_per_s: completion tokens over the whole request time."""
        end = self.last_token or time.monotonic()
        ttft = None if self.first_token is None else (self.first_token - self.arrival) * 1000
        tpot = self.tpot()
        total = end - self.arrival
        tps = completion_tokens / total if total > 0 and completion_tokens else 0.0
        return {"ttft_ms": _r(ttft), "tpot_ms": _r(None if tpot is None else tpot * 1000),
                "tokens_per_s": _r(tps)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
