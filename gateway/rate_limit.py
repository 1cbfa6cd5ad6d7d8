"""Per-client token buckets: `rate` requests per second refill, `burst` at most in the bucket.

A client is its API key when keys are on, else its address. Over the limit, `take` returns the
seconds until a token is back, which the route sends as Retry-After with its 429.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RateLimiter:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.max_clients = max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, last refill)

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, client: str) -> float:
        """Take one token: 0.0 if allowed, else seconds to wait for the next token."""
        if not self.enabled:
            return 0.0
        now = self.clock()
        tokens, last = self._buckets.get(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self._remember(client, tokens - 1.0, now)
            return 0.0
        self._remember(client, tokens, now)
        return (1.0 - tokens) / self.rate

    def _remember(self, client: str, tokens: float, now: float) -> None:
        if client not in self._buckets and len(self._buckets) >= self.max_clients:
            # Bound memory under many clients: forget full buckets (they equal a new one).
            full = [c for c, (t, _) in self._buckets.items() if t >= self.burst]
            for c in full:
                del self._buckets[c]
        self._buckets[client] = (tokens, now)
