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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def sse_event(payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse:
    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.headers = {**SSE_HEADERS, **(headers or {})}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]

        async def listen(scope_to_cancel: anyio.CancelScope) -> None:
            await _wait_disconnect(receive)
            await self.on_disconnect()
            scope_to_cancel.cancel()

        async def stream(scope_to_cancel: anyio.CancelScope) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
            try:
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the socket broke under us: same as a disconnect
                await self.on_disconnect()
            scope_to_cancel.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listen, tg.cancel_scope)
                tg.start_soon(stream, tg.cancel_scope)
        finally:
            closer = getattr(self.events, "aclose", None)
            if closer is not None:
                with anyio.CancelScope(shield=True):
                    await closer()


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
