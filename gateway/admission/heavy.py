"""Heavy requests: a client's requests with a large body, a few at once.

    headers: Content-Length over `min_bytes` (or none: a chunked body) ──hold(client)──▶ the
        client's share taken, or a 429 at once, before a byte of the body is read
    read, JSON parse, tokenizing, grammar compile ──▶ the share given back (any exit)

A body of hundreds of KB (a 600 KB JSON schema) costs the gateway's own event loop tens of ms to
parse and key, in calls that hold the GIL, so moving them to a thread would not free the loop.
One client sending them in a loop held the loop for most of each second and made an unrelated
chat wait seconds (issue 23). With `per_client` at once per client (its API key, else its
address), the rest are refused at the cost of reading their headers, and others are served.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter
from starlette.requests import Request

from gateway.http.errors import too_many_requests
from gateway.offload import Shares

MIN_BYTES = 64 * 1024
PER_CLIENT = 2


class Heavy:
    def __init__(self, per_client: int = PER_CLIENT, min_bytes: int = MIN_BYTES,
                 rejections: Counter | None = None) -> None:
        self.min_bytes = min_bytes
        self.rejections = rejections  # kestrel_rejections_total, labelled by reason
        self.shares = Shares(per_client)

    def is_heavy(self, request: Request) -> bool:
        declared = request.headers.get("content-length", "")
        return not (declared.isdigit() and int(declared) <= self.min_bytes)

    @contextmanager
    def hold(self, request: Request, client: str) -> Iterator[None]:
        if not self.is_heavy(request):
            yield
            return
        if not self.shares.take(client):
            if self.rejections is not None:
                self.rejections.labels("heavy_bodies").inc()
            raise too_many_requests(
                f"at most {self.shares.per_client} requests with bodies over "
                f"{self.min_bytes // 1024} KB at once from one client; retry when one has been "
                "answered", "server_busy", 1.0)
        try:
            yield
        finally:
            self.shares.give(client)
