"""Who is asking, and may they ask now: API keys and the per-client rate limit.

    Authorization: Bearer <key> (or x-api-key: <key>, as Anthropic's clients send it)
        ──check_key──▶ the key (None: keys are off) or 401
    the client (its key, else its address) ──RateLimiter.take──▶ allowed, or 429 with Retry-After

`guard` (the key, then the limit) runs first on every route but the liveness probes that
gateway.api.app lists (PROBES), before a body is read (`guard_keyed` on the routes that only
inform: the same with keys set, open without): no route is behind the key without being behind
the limit too. `check_key` alone is for guard.
"""

from __future__ import annotations

import hmac

from prometheus_client import Counter
from starlette.requests import Request

from gateway.admission.rate_limit import RateLimiter
from gateway.admission.shared_limits import SharedRateLimiter
from gateway.http.errors import APIError, too_many_requests


class Auth:
    def __init__(self, keys: frozenset[str], limiter: RateLimiter | SharedRateLimiter,
                 rejections: Counter | None = None) -> None:
        self.keys = keys
        # A configured key is text (a file is UTF-8); a header is latin-1-decoded bytes: both
        # become the bytes that would cross the wire, so a UTF-8 key still matches.
        self._key_bytes = [k.encode("utf-8") for k in keys]
        self.limiter = limiter
        self.rejections = rejections  # kestrel_rejections_total, labelled by reason

    def check_key(self, request: Request) -> str | None:
        """The caller's key, or None when keys are off; 401 when keys are on and it is wrong."""
        if not self.keys:
            return None
        auth = request.headers.get("authorization", "")
        if not auth and "x-api-key" in request.headers:  # Anthropic's header
            auth = "Bearer " + request.headers["x-api-key"]
        scheme, _, key = auth.partition(" ")
        # Compared as bytes: hmac.compare_digest refuses a non-ASCII str (TypeError, a 500),
        # and a header is whatever bytes the client sent (Starlette decodes them as latin-1).
        given = key.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not any(
                hmac.compare_digest(given, k) for k in self._key_bytes):
            raise APIError(401, "a valid API key is required: Authorization: Bearer <key> "
                           "(or x-api-key: <key>)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return key.strip()

    @staticmethod
    def client(request: Request, key: str | None) -> str:
        """Who a client is for its limits: its key, else its address."""
        return key or (request.client.host if request.client else "unknown")

    def guard_keyed(self, request: Request) -> None:
        """An information route's guard (/v1/models, /health, /metrics, /openapi.json, Ollama's
        tags, ps and show): with keys set, the key and the limit, as `guard`; without keys,
        neither, as before (probes and scrapers poll them, and no key is there to protect)."""
        if self.keys:
            self.guard(request)

    def guard(self, request: Request) -> str | None:
        """The key, then the rate limit; returns the caller's key (None: keys are off)."""
        key = self.check_key(request)
        wait = self.limiter.take(self.client(request, key))
        if wait > 0:
            if self.rejections is not None:
                self.rejections.labels("rate_limit").inc()
            # retry-after-ms carries the bucket's exact refill time.
            raise too_many_requests("rate limit exceeded for this client", "rate_limited", wait)
        return key
