"""Ollama's read-only routes: what models there are, what one is, which are loaded, the version.

    GET  /api/tags    every model this server can serve (with --models-dir, the folder's too)
    POST /api/show    {"model"} ──▶ its details, capabilities and chat template
    GET  /api/ps      the models loaded now (a worker serves them)
    GET  /api/version {"version"}

Errors as Ollama's: {"error": message}.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.dialects.ollama import VERSION, error_body
from gateway.engine.registry import ModelEntry
from gateway.http.body import read_json
from gateway.http.errors import APIError
from gateway.service import GatewayState


def _when(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat().replace("+00:00", "Z")


def _details(entry: ModelEntry | None) -> dict[str, Any]:
    h = entry.hello if entry is not None else None
    return {"parent_model": "", "format": "gguf" if h is None or "q" in h.quantization.lower()
            else "safetensors", "family": "", "families": None,
            "parameter_size": "", "quantization_level": h.quantization if h else ""}


def _model(name: str, entry: ModelEntry | None) -> dict[str, Any]:
    h = entry.hello if entry is not None else None
    return {"name": name, "model": name,
            "modified_at": _when(entry.created if entry is not None else 0),
            "size": h.weight_bytes if h else 0, "digest": entry.digest if entry else "",
            "details": _details(entry)}


def _catalog(state: GatewayState) -> dict[str, ModelEntry | None]:
    """Every servable name: the served models (and aliases), then the folder's others."""
    out: dict[str, ModelEntry | None] = {}
    for entry in state.client.models.values():
        for name in (entry.model_id, *entry.hello.aliases):
            out[name] = entry
    if state.models_on_demand is not None:
        for name in state.models_on_demand.catalog:
            out.setdefault(name, None)
    return out


async def _guarded(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    state.auth.guard_keyed(request)  # with keys set: the key, then the limit
    return state


def _error(exc: APIError) -> Response:
    return JSONResponse(error_body(exc.status, exc.message), exc.status, exc.headers)


async def tags(request: Request) -> Response:
    try:
        state = await _guarded(request)
    except APIError as exc:
        return _error(exc)
    return JSONResponse({"models": [_model(n, e) for n, e in _catalog(state).items()]})


async def ps(request: Request) -> Response:
    try:
        state = await _guarded(request)
    except APIError as exc:
        return _error(exc)
    models = [{**_model(n, e), "expires_at": _when(0), "size_vram": 0}
              for n, e in _catalog(state).items() if e is not None]
    return JSONResponse({"models": models})


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def show(request: Request) -> Response:
    try:
        state = await _guarded(request)
        data = await read_json(request, 4096, state.cfg.body_timeout_s, state.intake.readers)
        name = data.get("model") or data.get("name") if isinstance(data, dict) else None
        if not isinstance(name, str) or not name:
            raise APIError(400, "the body must name a model: {\"model\": NAME}")
        catalog = _catalog(state)
        if name not in catalog:
            raise APIError(404, f"model '{name}' not found")
        entry = catalog[name]
    except APIError as exc:
        return _error(exc)
    info: dict[str, Any] = {"details": _details(entry), "modified_at": _when(
        entry.created if entry else 0), "capabilities": ["completion"]}
    if entry is not None:
        h = entry.hello
        info["model_info"] = {"general.context_length": h.max_model_len,
                              "kestrel.kv_capacity_tokens": h.kv_capacity_tokens}
        info["template"] = h.tokenizer.chat_template or ""
        if entry.tokenizer.native_tools or "tools" in (h.tokenizer.chat_template or ""):
            info["capabilities"].append("tools")
        if h.embedding_size:
            info["capabilities"].append("embedding")
    return JSONResponse(info)
