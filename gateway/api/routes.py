"""The engine's routes: OpenAI's completions, chat completions and embeddings, and the native
API. Each is one Exchange (gateway.api.exchange): its way in, its answer, and one close, here or,
for a stream, in the stream's own end."""

from __future__ import annotations

import anyio
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.exchange import Exchange


async def run_route(request: Request, route: str) -> Response:
    exchange = Exchange(request.app.state.gateway, request, route)
    try:
        return await exchange.run()
    finally:
        if not exchange.streaming:  # a stream took it over: it closes it when it ends
            with anyio.CancelScope(shield=True):
                await exchange.close()


async def completions(request: Request) -> Response:
    return await run_route(request, "completions")


async def chat_completions(request: Request) -> Response:
    return await run_route(request, "chat")


async def embeddings(request: Request) -> Response:
    return await run_route(request, "embeddings")


async def generate(request: Request) -> Response:
    return await run_route(request, "generate")


async def generate_stream(request: Request) -> Response:
    return await run_route(request, "generate_stream")
