"""Server-sent events, and noticing a client that went away.

SSEResponse streams `data: <json>\\n\\n` events from an async iterator while a second task listens
for `http.disconnect`; a disconnect runs `on_disconnect` at once (it cancels the generation at the
worker) and stops the stream, so a cancel leaves the gateway within milliseconds, not at the next
token write. `until_disconnect` does the same for non-streamed responses, which otherwise would
never read the socket again before answering.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.types import Message, Receive, Scope, Send

T = TypeVar("T")

KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic
DEADLINE_GRACE_S = 1.0  # after its deadline, a stream may still send its last events this long
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def sse_event(payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def sse_typed_event(chunk: dict[str, Any]) -> bytes:
    """An event named by its own `type` (`event: <type>`), as Anthropic's and OpenAI's
    Responses streams frame theirs."""
    data = json.dumps(chunk, separators=(",", ":"))
    return f"event: {chunk['type']}\ndata: {data}\n\n".encode()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse:
    """Streams `events`; while none comes for `keepalive_s`, sends an SSE comment instead.

    Every send is bounded: by `send_timeout_s`, and by the request's `deadline` (plus a short
    grace for the final events). A client that does not read blocks a send on TCP backpressure;
    when the bound passes, the stream ends as if it had disconnected (`on_disconnect` frees its
    place and cancels the work), so its admission slot is back at its deadline at the latest.

    The events are read and written by one task with no timer of its own: a send that does not
    block costs a lock and two clock reads. A watchdog task beside it, waking every `tick`
    (at most a second), sends the keep-alive comments and ends a send that overran its bound,
    so the per-event cost does not grow with these two duties.
    """

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None, *, deadline: float | None = None,
                 keepalive_s: float = 10.0, send_timeout_s: float = 10.0,
                 media_type: str = "text/event-stream; charset=utf-8",
                 keepalive: bytes | None = KEEPALIVE) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.headers = {**SSE_HEADERS, **(headers or {})}
        self.deadline = deadline  # monotonic
        self.keepalive_s = keepalive_s
        self.send_timeout_s = send_timeout_s
        self.media_type = media_type  # (JSON lines, for Ollama's API, are streamed the same way)
        self.keepalive = keepalive  # None: the format has no comment to send
        self.tick = min(1.0, keepalive_s / 2, send_timeout_s / 2)

    def _send_limit(self) -> float:
        if self.deadline is None:
            return self.send_timeout_s
        return min(self.send_timeout_s,
                   max(0.0, self.deadline - time.monotonic()) + DEADLINE_GRACE_S)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [(b"content-type", self.media_type.encode())]
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        lock = asyncio.Lock()  # the stream and the watchdog's keep-alives take turns
        last_write = time.monotonic()
        write_due: float | None = None  # the send in progress must be done by then

        async def write(message: Message) -> None:
            nonlocal last_write, write_due
            async with lock:
                write_due = time.monotonic() + self._send_limit()
                await send(message)
                write_due = None
                last_write = time.monotonic()

        def body(chunk: bytes, more: bool = True) -> Message:
            return {"type": "http.response.body", "body": chunk, "more_body": more}

        async def listen(scope_to_cancel: anyio.CancelScope) -> None:
            await _wait_disconnect(receive)
            await self.on_disconnect()
            scope_to_cancel.cancel()

        async def watchdog(scope_to_cancel: anyio.CancelScope) -> None:
            while True:
                await asyncio.sleep(self.tick)
                now = time.monotonic()
                if write_due is not None and now > write_due:
                    break  # the client stopped taking what we send
                if self.keepalive and write_due is None and not lock.locked() and \
                        now - last_write >= self.keepalive_s:  # a comment keeps proxies quiet
                    with anyio.move_on_after(self._send_limit()) as limit:
                        await write(body(self.keepalive))
                    if limit.cancelled_caught:
                        break
            await self.on_disconnect()
            scope_to_cancel.cancel()

        async def stream(scope_to_cancel: anyio.CancelScope) -> None:
            ok = True
            try:
                await write({"type": "http.response.start", "status": 200,
                             "headers": raw_headers})
                async for chunk in self.events:
                    await write(body(chunk))
                await write(body(b"", more=False))
            except OSError:  # the socket broke under us: same as a disconnect
                ok = False
            if not ok:
                await self.on_disconnect()
            scope_to_cancel.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listen, tg.cancel_scope)
                tg.start_soon(watchdog, tg.cancel_scope)
                tg.start_soon(stream, tg.cancel_scope)
        finally:
            with anyio.CancelScope(shield=True):
                closer = getattr(self.events, "aclose", None)
                if closer is not None:
                    await closer()


class ClientGone(Exception):
    """The client left while its request waited (for its model, its tokens or its slot)."""


async def unless_gone(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result (never None); ClientGone if the client disconnects first, once `work`
    has been cancelled and has unwound (what it held is then its owner's to give back)."""
    done = await until_disconnect(receive, work, _nothing)
    if done is None:
        raise ClientGone
    return done


async def _nothing() -> None:
    return None


async def until_disconnect(receive: Receive, work: Awaitable[T],
                           on_disconnect: Callable[[], Awaitable[None]],
                           on_abandoned: Callable[[T], Awaitable[None]] | None = None) -> T | None:
    """Await `work`; if the client disconnects first, cancel it, run `on_disconnect`, return
    None (nobody is listening for the answer). If `work` still produced a result (it finished
    as it was cancelled), that result goes to `on_abandoned`, which must release it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await on_disconnect()
        await asyncio.gather(task, return_exceptions=True)
        if on_abandoned is not None and not task.cancelled() and task.exception() is None:
            await on_abandoned(task.result())
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
