"""A fake engine worker behind the real EngineClient: no sockets, scripted answers.

The link's own bookkeeping (registry, router, request handles, dispatch) runs for real; only the
socket is replaced, by `LoopbackLink`, an in-memory link that meets the gateway's LinkSurface
(gateway/engine/link.py), as tests/gateway/engine/test_engine_client.py's does. A Generate is
answered by scheduling StepOutputs frames through the client's own dispatch, as its receive loop
would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.dialects.served import DIALECTS
from gateway.engine.engine_client import EngineClient
from gateway.engine.registry import WorkerState
from gateway.http.schemas import ChatCompletionRequest
from gateway.output.generation import Generation
from gateway.prompt.intake import EngineRequest
from gateway.prompt.tools import ToolPlan
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import codec
from protocol import messages as m

# Every engine route's one record (gateway.dialects.served), and intake's part of it, by the
# route's name.
ENDPOINTS = {endpoint.route.name: endpoint for dialect in DIALECTS
             for endpoint in dialect.endpoints}
ROUTES = {name: endpoint.route for name, endpoint in ENDPOINTS.items()}


class LoopbackLink:
    """An engine link in memory: what the gateway sends goes to `on_send`; what a test puts in
    `incoming` is what it receives; no peer ever disconnects."""

    def __init__(self, on_send: Callable[[bytes, Any], Awaitable[bool]]) -> None:
        self.on_send = on_send
        self.incoming: asyncio.Queue[tuple[bytes, list[bytes]]] | None = None
        self.bound = self.closed = False

    def bind(self) -> None:
        self.bound = True

    def close(self) -> None:
        self.closed = True

    async def recv(self) -> tuple[bytes, list[bytes]]:
        if self.incoming is None:
            self.incoming = asyncio.Queue()
        return await self.incoming.get()

    async def send(self, identity: bytes, msg: Any) -> bool:
        return await self.on_send(identity, msg)

    async def next_disconnect(self) -> None:
        await asyncio.Event().wait()


class FakeEngine:
    """One worker serving `model_id`; each Generate gets `tokens` (one step each) per choice,
    the last step's frames with `finish_reason`."""

    def __init__(self, client: EngineClient, info: m.TokenizerInfo,
                 tokenizer: GatewayTokenizer, model_id: str = "tiny", max_model_len: int = 2048,
                 tokens: tuple[int, ...] = (1, 2, 3), finish_reason: str = "length") -> None:
        self.client = client
        self.tokens = tokens
        self.finish_reason = finish_reason
        self.sent: list[Any] = []
        self._tasks: set[asyncio.Task] = set()
        hello = m.Hello(m.PROTOCOL_VERSION, "fake-worker", model_id, max_model_len, 65536, 8, info)
        self.worker: WorkerState = client.registry.admit(
            b"fake", hello, codec.tokenizer_digest(info), tokenizer)
        client.link = client.membership.link = LoopbackLink(self._send)

    async def _send(self, identity: bytes, msg: Any) -> bool:
        self.sent.append(msg)
        if isinstance(msg, m.Generate):
            task = asyncio.get_running_loop().create_task(self._answer(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    async def _answer(self, gen: m.Generate) -> None:
        # One StepOutputs per step, every choice's token in it, as a worker sends them.
        for k, token in enumerate(self.tokens):
            last = k == len(self.tokens) - 1
            await self.client._dispatch(self.worker, m.StepOutputs([m.TokenOutput(
                gen.request_id, index, [token], self.finish_reason if last else None,
                prompt_tokens=len(gen.prompt_token_ids), completion_tokens=k + 1,
                since_scheduled_s=0.001 if k == 0 else None) for index in range(gen.params.n)]))


def answered(route: str, body: dict[str, Any], info: m.TokenizerInfo, tok: GatewayTokenizer,
             answer: str, finish: str = "stop", prompt: str = "Hi", **params: Any
             ) -> tuple[Any, list[Any]]:
    """The formatter of `route` (the exchange's, any dialect's) for `body`, which the fake
    engine answers with `answer`, one token a frame; and the ChoiceEvents its Generation gave.
    `params`: the SamplingParams (max_tokens: the body's, else 64)."""
    spec = ROUTES[route]
    parsed = spec.parse(body) if spec.parse else spec.schema.model_validate(body)
    plan = ToolPlan.from_request(parsed) if isinstance(parsed, ChatCompletionRequest) else None
    params.setdefault("max_tokens", getattr(parsed, "max_tokens", None) or 64)

    async def go() -> tuple[Any, list[Any]]:
        client = EngineClient("inproc://unused")
        engine = FakeEngine(client, info, tok, tokens=tuple(tok.encode(answer)),
                            finish_reason=finish)
        now = time.monotonic()
        req = EngineRequest(route, parsed, now, now + 30,
                            parsed.stream if spec.stream is None else spec.stream,
                            client.models["tiny"], tok.encode(prompt),
                            m.SamplingParams(**params), parsed.stop_list(), tool_plan=plan)
        gen = Generation(client, req.model, req.prompt_ids, req.params, req.stop, req.deadline,
                         req.arrival, request_id="rid-1")
        await gen.start()
        events = [event async for event in gen.events()]
        assert engine.sent and isinstance(engine.sent[0], m.Generate)
        client.link.close()
        return ENDPOINTS[route].formatter(req, gen), events

    return asyncio.run(go())


def whole(fmt: Any, events: list[Any]) -> dict[str, Any]:
    """The formatter's answer to a request not streamed."""
    for event in events:
        fmt.add(event)
    return fmt.response()


def streamed(fmt: Any, events: list[Any]) -> list[dict[str, Any]]:
    """The formatter's stream, every event of it."""
    chunks = fmt.stream_start()
    for event in events:
        chunks += fmt.stream_event(event)
    return chunks + fmt.stream_end()
