"""A fake engine worker behind the real EngineClient: no sockets, scripted answers.

The link's own bookkeeping (registry, router, request handles, dispatch) runs for real; only the
socket is replaced, by `LoopbackLink`, an in-memory link that meets the gateway's LinkSurface
(gateway/engine/link.py), as tests/gateway/engine/test_engine_client.py's does. A Generate is
answered by scheduling StepOutputs frames through the client's own dispatch, as its receive loop
would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.engine.engine_client import EngineClient
from gateway.engine.registry import WorkerState
from gateway.prompt.tokenizer import GatewayTokenizer
from protocol import codec
from protocol import messages as m


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
