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

from gateway.errors import too_many_requests

MIN_BYTES = 64 * 1024
PER_CLIENT = 2


class Heavy:
    def __init__(self, per_client: int = PER_CLIENT, min_bytes: int = MIN_BYTES,
                 rejections: Counter | None = None) -> None:
        self.per_client = per_client
        self.min_bytes = min_bytes
        self.rejections = rejections  # kestrel_rejections_total, labelled by reason
        self.by_client: dict[str, int] = {}  # only clients holding a share: bounded

    def is_heavy(self, request: Request) -> bool:
        declared = request.headers.get("content-length", "")
        return not (declared.isdigit() and int(declared) <= self.min_bytes)

    @contextmanager
    def hold(self, request: Request, client: str) -> Iterator[None]:
        if not self.is_heavy(request):
            yield
            return
        held = self.by_client.get(client, 0)
        if held >= self.per_client:
            if self.rejections is not None:
                self.rejections.labels("heavy_bodies").inc()
            raise too_many_requests(
                f"at most {self.per_client} requests with bodies over {self.min_bytes // 1024} "
                "KB at once from one client; retry when one has been answered",
                "server_busy", 1.0)
        self.by_client[client] = held + 1
        try:
            yield
        finally:
            left = self.by_client.pop(client, 1) - 1
            if left > 0:
                self.by_client[client] = left
