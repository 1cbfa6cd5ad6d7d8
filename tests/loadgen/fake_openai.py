"""An in-process fake OpenAI-compatible server for the load generator's tests.

aiohttp.web on 127.0.0.1 (a random free port) in its own thread and event loop, so a test can drive
it with `asyncio.run(run_load(...))` or with the CLI's `main()` alike. It streams one chunk per
"token" (max_tokens of them with ignore_eos, else at most EARLY_STOP), shaped like kestrel's: a chat
role preamble, usage on the final choice chunk and in the include_usage chunk, then [DONE]. It can
answer every k-th request with 429, fail every k-th stream with an error event, hold each request
before its first byte (a "saturated" server), serve at most `capacity` streams at once (the rest
queue: a server with a real throughput limit, for the hockey stick), and split writes mid-line.
It records what it saw.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

from aiohttp import web

EARLY_STOP = 3  # tokens generated when ignore_eos is absent: "the model hit EOS"


class FakeOpenAI:
    def __init__(self, *, model: str = "fake-model", chunk_delay_s: float = 0.001,
                 first_delay_s: float = 0.0, reject_every: int = 0, error_every: int = 0,
                 split_writes: bool = False, capacity: int = 0) -> None:
        self.model = model
        self.chunk_delay_s = chunk_delay_s
        self.first_delay_s = first_delay_s
        self.reject_every = reject_every
        self.error_every = error_every
        self.split_writes = split_writes
        self.capacity = capacity
        self._slots: asyncio.Semaphore | None = None
        self.count = 0
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.peers: list[object] = []  # each request's client address: one per connection
        self.arrivals: list[float] = []  # perf_counter when each POST reached the handler
        self.in_flight = 0
        self.max_in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        if self.capacity:
            self._slots = asyncio.Semaphore(self.capacity)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.SockSite(self._runner, self._sock).start())
        self._ready.set()
        self._loop.run_forever()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.arrivals.append(time.perf_counter())
        n = self.count
        self.count += 1
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        self.peers.append(request.transport.get_extra_info("peername") if request.transport
                          else None)
        if self.reject_every and n % self.reject_every == self.reject_every - 1:
            return web.json_response({"error": {"message": "queue full", "type": "rate_limit_error",
                                                "code": "queue_full"}}, status=429,
                                     headers={"Retry-After": "1"})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self._slots is None:
                return await self._stream(request, body, n)
            async with self._slots:
                return await self._stream(request, body, n)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, body: dict[str, Any], n: int
                      ) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        if chat:
            prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
        else:
            prompt_tokens = len(body["prompt"].split())
        tokens = body["max_tokens"] if body.get("ignore_eos") else min(EARLY_STOP,
                                                                        body["max_tokens"])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                 "total_tokens": prompt_tokens + tokens}
        await asyncio.sleep(self.first_delay_s)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(payload: Any) -> None:
            data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
            raw = data.encode()
            if self.split_writes:  # a line cut in two across network reads
                await resp.write(raw[: len(raw) // 2])
                await asyncio.sleep(0.001)
                raw = raw[len(raw) // 2:]
            await resp.write(raw)

        base = {"id": f"req-{n}", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0, "model": self.model}
        if chat:
            await send({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                             "finish_reason": None}]})
        for i in range(tokens):
            await asyncio.sleep(self.chunk_delay_s)
            if self.error_every and n % self.error_every == self.error_every - 1 and i == 1:
                await send({"error": {"message": "worker lost", "type": "server_error",
                                      "code": "worker_lost"}})
                break
            last = i == tokens - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            choice.update({"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"})
            await send({**base, "choices": [choice], **({"usage": usage} if last else {})})
        else:
            if (body.get("stream_options") or {}).get("include_usage"):
                await send({**base, "choices": [], "usage": usage})
        await send("[DONE]")
        await resp.write_eof()
        return resp
