"""The HTTP side: one request per call (streamed, or whole), recorded into a RequestRecord.

    RequestSpec ──build_request──▶ POST {base}/completions | /chat/completions (stream)
      ──aiohttp reads (any split)──▶ SSEParser ──data──▶ RequestRecord.on_event(t) ──▶ [DONE]

Every outcome lands in the record, never in an exception: 429 is a rejection, another status or a
`data: {"error": ...}` event is an error with its message, a broken connection or timeout is an
error with status 0. The session must not queue requests client-side (an aiohttp connection pool
limit would): an open loop's send time has to be when the request really left, so `new_session`
builds a connector without a limit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from loadgen.record import RequestRecord, error_text
from loadgen.sse import SSEParser


def new_session(timeout_s: float, keepalive: bool = True) -> aiohttp.ClientSession:
    # limit=0: no pool cap, so nothing waits for a free connection before it is sent.
    # keepalive=False closes each connection after its response (force_close): some servers
    # close idle keep-alive connections as the client picks one to reuse, failing the request.
    connector = aiohttp.TCPConnector(limit=0, force_close=not keepalive)
    return aiohttp.ClientSession(connector=connector,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def fetch_model(session: aiohttp.ClientSession, base_url: str,
                      headers: Mapping[str, str]) -> str:
    """The first model id from GET {base_url}/models."""
    async with session.get(f"{base_url.rstrip('/')}/models", headers=dict(headers)) as resp:
        if resp.status != 200:
            detail = error_text(await resp.text())
            raise RuntimeError(f"GET /models answered {resp.status}: {detail}")
        data = (await resp.json()).get("data") or []
    if not data or "id" not in data[0]:
        raise RuntimeError("GET /models listed no models; pass --model")
    return str(data[0]["id"])


async def send_request(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any],
                       headers: Mapping[str, str], record: RequestRecord, run_start: float) -> None:
    """POST `body` to `url` as a stream and fill `record`. `run_start` is the run's perf_counter
    origin; the send time is taken here, as the request task starts, so event-loop delays before
    it count as send lag rather than as server latency."""
    sent = time.perf_counter()
    record.sent_s = sent - run_start
    try:
        async with session.post(url, json=dict(body), headers=dict(headers)) as resp:
            record.status = resp.status
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {error_text(await resp.text())}"
                return
            ctype = resp.headers.get("Content-Type", "")
            if body.get("stream") is False:
                if not ctype.startswith("application/json"):
                    record.error = f"expected JSON, got {ctype or 'no content type'}"
                    return
                obj = await resp.json()
                record.on_response(obj, time.perf_counter(), sent)
                return
            if not ctype.startswith("text/event-stream"):
                record.error = f"expected an event stream, got {ctype or 'no content type'}"
                return
            await _read_stream(resp, record, sent)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:500] if str(exc) else type(exc).__name__
    finally:
        record.e2e_s = time.perf_counter() - sent


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord, sent: float) -> None:
    parser = SSEParser()
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()  # one read's events share an arrival time: they came together
        for data in parser.feed(chunk):
            if record.on_event(data, now, sent):
                return
    now = time.perf_counter()
    for data in parser.flush():
        if record.on_event(data, now, sent):
            return
    if record.error is None:
        record.error = "the stream ended before [DONE]"
