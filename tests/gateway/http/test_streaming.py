"""gateway/http/streaming.py SSEResponse against fake ASGI peers: a client that never takes a send
(TCP backpressure) loses its stream at its deadline, and a quiet stream gets keep-alive comments."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.types import Message

from gateway.http.streaming import KEEPALIVE, SSEResponse


async def _never_disconnects() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def test_a_send_that_blocks_ends_the_stream_at_the_deadline() -> None:
    async def body() -> None:
        sent: list[Message] = []
        disconnected = asyncio.Event()

        async def send(message: Message) -> None:
            sent.append(message)
            if message["type"] == "http.response.body":
                await asyncio.Event().wait()  # the client stopped reading: blocks for ever

        async def events() -> AsyncIterator[bytes]:
            while True:
                yield b"data: x\n\n"

        async def on_disconnect() -> None:
            disconnected.set()

        deadline = time.monotonic() + 0.3
        response = SSEResponse(events(), on_disconnect, deadline=deadline, send_timeout_s=60)
        start = time.monotonic()
        await asyncio.wait_for(response({"type": "http"}, _never_disconnects, send), 10)
        # The deadline plus the grace for the last events, not the 60 s send timeout.
        assert time.monotonic() - start < 3
        assert disconnected.is_set()

    asyncio.run(body())


def test_a_send_slower_than_send_timeout_ends_the_stream() -> None:
    async def body() -> None:
        disconnected = asyncio.Event()

        async def send(message: Message) -> None:
            if message["type"] == "http.response.body":
                await asyncio.sleep(30)

        async def events() -> AsyncIterator[bytes]:
            yield b"data: x\n\n"

        async def on_disconnect() -> None:
            disconnected.set()

        response = SSEResponse(events(), on_disconnect, send_timeout_s=0.2)
        await asyncio.wait_for(response({"type": "http"}, _never_disconnects, send), 5)
        assert disconnected.is_set()

    asyncio.run(body())


def test_a_quiet_stream_gets_keep_alive_comments_then_its_events() -> None:
    async def body() -> None:
        bodies: list[bytes] = []

        async def send(message: Message) -> None:
            if message["type"] == "http.response.body":
                bodies.append(message["body"])

        async def events() -> AsyncIterator[bytes]:
            await asyncio.sleep(0.35)  # e.g. waiting in the queue
            yield b"data: 1\n\n"

        async def nothing() -> None:
            return None

        response = SSEResponse(events(), nothing, keepalive_s=0.1)
        await asyncio.wait_for(response({"type": "http"}, _never_disconnects, send), 5)
        assert bodies.count(KEEPALIVE) >= 2
        assert bodies[-2:] == [b"data: 1\n\n", b""]

    asyncio.run(body())
