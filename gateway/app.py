"""The gateway's Starlette app: routes, lifespan, health, models and metrics.

    lifespan: bind the engine link (workers connect and say Hello) ... on exit, close it.
    /v1/completions, /v1/chat/completions, /v1/embeddings,
    /v1/generate[/stream]                                           -> gateway.routes
    /tokenize, /detokenize                                          -> gateway.tokenize_routes
    /v1/models, /health, /health/live, /health/ready, /metrics (and /v1/metrics), /openapi.json
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import errors, routes, tokenize_routes
from gateway.config import GatewayConfig
from gateway.offload import LoopLag
from gateway.openapi import OpenAPIDocument, server_figures
from gateway.service import GatewayState


def create_app(cfg: GatewayConfig) -> Starlette:
    state = GatewayState(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        await state.client.start()
        lag = asyncio.create_task(LoopLag(state.metrics.loop_lag.observe).watch(), name="loop-lag")
        try:
            yield
        finally:
            lag.cancel()
            await state.client.close()
            if state.accounting.tracer is not None:
                state.accounting.tracer.shutdown()  # flush the last spans

    app = Starlette(routes=[
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", routes.embeddings, methods=["POST"]),
        Route("/v1/generate", routes.generate, methods=["POST"]),
        Route("/v1/generate/stream", routes.generate_stream, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/tokenize", tokenize_routes.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize_routes.detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health/live", live, methods=["GET"]),
        Route("/health/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.gateway = state
    app.state.openapi = OpenAPIDocument()  # the served models' figures added per request
    state.http_in_flight = errors.install(app)
    return app


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


async def list_models(request: Request) -> Response:
    state = _state(request)
    state.auth.check_key(request)
    return JSONResponse({"object": "list", "data": state.models()})


async def health(request: Request) -> Response:
    """Models, workers, devices and queue figures: an API key's business when keys are set."""
    state = _state(request)
    if not state.cfg.open_metrics:
        state.auth.check_key(request)
    return JSONResponse(state.health(), status_code=200 if state.ready else 503)


async def live(request: Request) -> Response:
    return JSONResponse({"status": "alive"})


async def ready(request: Request) -> Response:
    state = _state(request)
    body = state.health()
    return JSONResponse({"status": body["status"]}, status_code=200 if state.ready else 503)


async def metrics(request: Request) -> Response:
    state = _state(request)
    if not state.cfg.open_metrics:  # per-worker cache counters help a tenant probe another
        state.auth.check_key(request)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def openapi_json(request: Request) -> Response:
    state = _state(request)
    figures = server_figures(state.cfg, state.client.registry)
    return Response(request.app.state.openapi.render(figures), media_type="application/json")
