"""Per-client token buckets: `rate` requests per second refill, `burst` at most in the bucket.

A client is its API key when keys are on, else its address (the peer's, or the one a trusted
proxy put in X-Forwarded-For: uvicorn rewrites it only for the proxies in `forwarded_allow_ips`).
Over the limit, `take` returns the seconds until a token is back, which the route sends as
Retry-After with its 429.

Buckets live in an OrderedDict kept in least-recently-used order: each `take` moves its client to
the end, so the front is the client idle longest. A bucket idle for burst/rate seconds has refilled
to full, which is the same as no bucket: `take` drops such buckets from the front (amortized O(1)
per request: each bucket is dropped once), and beyond `max_clients` the least recently used ones.
No scan over all clients ever runs on the event loop, and an idle client is forgotten.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class RateLimiter:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.max_clients = max_clients
        # client -> (tokens, last refill); invariant: ordered by last refill, oldest first.
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, client: str) -> float:
        """Take one token: 0.0 if allowed, else seconds to wait for the next token."""
        if not self.enabled:
            return 0.0
        now = self.clock()
        self._forget_idle(now)
        tokens, last = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)  # refill first
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[client] = (tokens, now)  # at the end: the most recently used
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait

    def _forget_idle(self, now: float) -> None:
        # Buckets are in refill-time order, so the first that is not full yet ends the sweep.
        while self._buckets:
            tokens, last = next(iter(self._buckets.values()))
            if tokens + (now - last) * self.rate < self.burst:
                return
            self._buckets.popitem(last=False)
