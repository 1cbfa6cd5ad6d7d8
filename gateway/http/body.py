"""A request's JSON body, read with limits: size (413), time (408), a client that leaves (499),
bad JSON or a lone UTF-16 surrogate (400), SIGTERM while it arrives (503). Called by Intake.read
before validation.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request

from gateway.http.errors import APIError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class Readers:
    """The bodies being read now. On SIGTERM `stop()` ends them with a 503 at once: nothing
    was admitted, and a body still trickling in would otherwise hold the drain until its own
    timeout, or until the server's last resort cancels it mid-request (a 500)."""

    def __init__(self) -> None:
        self._scopes: set[anyio.CancelScope] = set()
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True
        for scope in self._scopes:
            scope.cancel()


async def read_json(request: Request, max_body_bytes: int, body_timeout_s: float,
                    readers: Readers | None = None) -> Any:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise APIError(413, f"the body is over {max_body_bytes} bytes",
                       code="body_too_large")
    readers = readers or Readers()
    chunks, size = [], 0
    try:
        # A body trickled in a byte at a time would hold its connection (and, once admitted,
        # nothing else) for ever: the whole body has body_timeout_s.
        with anyio.fail_after(body_timeout_s), anyio.CancelScope() as scope:
            readers._scopes.add(scope)
            if readers.stopped:
                scope.cancel()
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_body_bytes:
                        raise APIError(413, f"the body is over {max_body_bytes} bytes",
                                       code="body_too_large")
                    chunks.append(chunk)
            finally:
                readers._scopes.discard(scope)
        if scope.cancelled_caught:
            raise APIError(503, "the server is shutting down", code="shutting_down")
    except ClientDisconnect:  # an ordinary event, not a bug: no trace in the log
        raise APIError(499, "the client left while sending its body",
                       code="client_closed") from None
    except TimeoutError:
        raise APIError(408, f"the body did not arrive within {body_timeout_s} s",
                       code="body_timeout", headers={"Connection": "close"}) from None
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    # json accepts an escaped lone surrogate ("\ud800"), which is no Unicode text: the
    # tokenizer and the UTF-8 encoder would fail on it deep inside the request.
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise APIError(400, "the body is not valid JSON: a string has a lone UTF-16 surrogate",
                       code="invalid_json")
    return data
