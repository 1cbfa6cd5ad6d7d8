"""The gateway's Starlette app: routes, lifespan, health, models and metrics.

    lifespan: bind the engine link (workers connect and say Hello) ... on exit, close it.
    each dialect record's endpoints (gateway.dialects.served: /v1/completions,
    /v1/chat/completions, /v1/embeddings, /v1/generate[/stream], /v1/responses, /v1/messages,
    /api/chat, /api/generate)                                       -> gateway.api.exchange
    and its side routes (Ollama's /api/tags, /api/ps, /api/show, /api/version)
    /tokenize, /detokenize, /v1/messages/count_tokens               -> gateway.api.tokenize_routes
    /v1/models, /health, /health/live, /health/ready, /metrics (and /v1/metrics), /openapi.json
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from functools import partial

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api import tokenize_routes
from gateway.api.exchange import answer
from gateway.api.openapi import OpenAPIDocument, server_figures
from gateway.config import GatewayConfig
from gateway.dialects.record import Dialect
from gateway.dialects.served import DIALECTS
from gateway.engine.on_demand import OnDemand, Spawner
from gateway.http import errors
from gateway.http.body import read_json
from gateway.http.errors import APIError, validated
from gateway.http.schemas import ModelRequest
from gateway.offload import LoopLag
from gateway.service import GatewayState

# The one rule (issue 54): every route is behind the API key (when keys are set) and the rate
# limit (auth.guard; auth.guard_keyed where a route only informs), but these liveness probes,
# which say nothing of the models or the load. /health and /metrics: open with --open-metrics.
PROBES = ("/health/live", "/health/ready", "/api/version")


def create_app(cfg: GatewayConfig, spawner: Spawner | None = None,
               dialects: Sequence[Dialect] = DIALECTS) -> Starlette:
    """The app serving `dialects` (each engine route one Exchange, told its record) beside the
    server's own routes."""
    state = GatewayState(cfg, spawner)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        await state.client.start()
        lag = asyncio.create_task(LoopLag(state.metrics.loop_lag.observe).watch(), name="loop-lag")
        pool = state.models_on_demand
        sleeper = (asyncio.create_task(pool.run(), name="models-on-demand")
                   if pool is not None else None)  # their lifecycle moves whoever waits
        try:
            yield
        finally:
            lag.cancel()
            if sleeper is not None:
                sleeper.cancel()
            await state.client.close()
            if state.accounting.tracer is not None:
                state.accounting.tracer.shutdown()  # flush the last spans

    app = Starlette(routes=[
        *(Route(endpoint.path, partial(answer, endpoint=endpoint), methods=["POST"])
          for dialect in dialects for endpoint in dialect.endpoints),
        *(Route(side.path, side.handler, methods=[side.method])
          for dialect in dialects for side in dialect.side_routes),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/models/load", load_model, methods=["POST"]),
        Route("/models/unload", unload_model, methods=["POST"]),
        Route("/tokenize", tokenize_routes.tokenize, methods=["POST"]),
        Route("/v1/messages/count_tokens", tokenize_routes.count_tokens, methods=["POST"]),
        Route("/detokenize", tokenize_routes.detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health/live", live, methods=["GET"]),
        Route("/health/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.gateway = state
    # the served models' figures added per request; /models/(un)load only where they are served
    app.state.openapi = OpenAPIDocument(dialects, on_demand=state.models_on_demand is not None)
    state.http_in_flight = errors.install(app)
    return app


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


async def list_models(request: Request) -> Response:
    state = _state(request)
    state.auth.guard_keyed(request)
    return JSONResponse({"object": "list", "data": state.models()})


async def _pool_request(request: Request) -> tuple[OnDemand, str]:
    """The on-demand pool and the body's model: 404 without --models-dir, 422 a bad body; an
    operator's route: with API keys set, 403 for a key not in --admin-keys."""
    state = _state(request)
    key = state.auth.guard(request)
    if key is not None and key not in state.cfg.admin_key_set():
        raise APIError(403, "loading and unloading models is for the keys in --admin-keys",
                       code="admin_key_required")
    pool = state.models_on_demand
    if pool is None:
        raise APIError(404, "models are loaded and unloaded by hand only with `kestrel serve "
                       "--models-dir`", code="not_found")
    data = await read_json(request, 4096, state.cfg.body_timeout_s, state.intake.readers)
    return pool, validated(ModelRequest, data).model  # the schema /openapi.json states


async def load_model(request: Request) -> Response:
    """POST /models/load {"model": id}: start its worker (if not loaded) and wait for it."""
    pool, name = await _pool_request(request)
    if name not in pool.catalog:
        raise APIError(404, f"model {name!r} is not in the models folder", param="model",
                       code="model_not_found")
    await pool.ensure(name, None)
    return JSONResponse({"model": name, "status": pool.status(name)})


async def unload_model(request: Request) -> Response:
    """POST /models/unload {"model": id}: stop its worker (409 while it has requests)."""
    pool, name = await _pool_request(request)
    pool.unload(name)
    return JSONResponse({"model": name, "status": pool.status(name)})


async def health(request: Request) -> Response:
    """Models, workers, devices and queue figures: an API key's business when keys are set."""
    state = _state(request)
    if not state.cfg.open_metrics:
        state.auth.guard_keyed(request)
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
        state.auth.guard_keyed(request)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def openapi_json(request: Request) -> Response:
    """The API's description, with the served models' ids: behind the key, as /v1/models is."""
    state = _state(request)
    state.auth.guard_keyed(request)
    figures = server_figures(state.cfg, state.client.registry)
    return Response(request.app.state.openapi.render(figures), media_type="application/json")
