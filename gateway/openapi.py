"""`/openapi.json`: the gateway's OpenAPI 3.1 description, built once from the pydantic request
schemas (gateway.schemas, through the routes' formatters), so it cannot drift from what the
routes validate.

    ROUTES (path, method, request model or None, summary) ──pydantic models_json_schema──▶
        components.schemas + one operation per route, each with its error responses

Response bodies are described loosely (an object; an SSE stream for streams) except the error
shape, which every route shares: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.intake import ROUTES as INTAKE_ROUTES

REF = "#/components/schemas/{model}"
ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}
# Statuses any route may answer (besides its own 200), and what they mean here.
COMMON_ERRORS = {"401": "a valid API key is required", "429": "rate limited, or the queue is "
                 "full or too slow for the request's deadline (see Retry-After)",
                 "503": "no worker, or shutting down"}
GENERATION_ERRORS = {"400": "bad JSON, a prompt beyond the context, a template error",
                     "408": "the body did not arrive in time", "413": "the body is too large",
                     "422": "a field is invalid", "404": "the model is not served here",
                     "504": "the request's deadline passed"}

# path, method, request model (or None), summary, streams
ROUTES: list[tuple[str, str, type[BaseModel] | None, str, bool]] = [
    ("/v1/completions", "post", INTAKE_ROUTES["completions"].schema,
     "OpenAI text completion (stream: true for SSE)", True),
    ("/v1/chat/completions", "post", INTAKE_ROUTES["chat"].schema,
     "OpenAI chat completion (stream: true for SSE)", True),
    ("/v1/generate", "post", INTAKE_ROUTES["generate"].schema, "native generation", False),
    ("/v1/generate/stream", "post", INTAKE_ROUTES["generate_stream"].schema,
     "native generation, streamed as SSE", True),
    ("/v1/models", "get", None, "the models the ready workers serve", False),
    ("/health", "get", None, "status, workers and queue (503 when not ready)", False),
    ("/health/live", "get", None, "the process answers", False),
    ("/health/ready", "get", None, "ready for work (503 otherwise)", False),
    ("/metrics", "get", None, "Prometheus metrics", False),
    ("/v1/metrics", "get", None, "Prometheus metrics", False),
    ("/openapi.json", "get", None, "this document", False),
]


def _error(text: str) -> dict[str, Any]:
    return {"description": text,
            "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}


def build_openapi(title: str = "kestrel", version: str = "0.1.0") -> dict[str, Any]:
    models = [(model, "validation") for _, _, model, _, _ in ROUTES if model is not None]
    names, defs = models_json_schema(models, ref_template=REF)
    schemas: dict[str, Any] = {**defs.get("$defs", {}), "Error": ERROR}
    paths: dict[str, Any] = {}
    for path, method, model, summary, streams in ROUTES:
        ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
        if path.endswith("metrics"):
            ok = {"text/plain": {"schema": {"type": "string"}}}
        if streams:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        op: dict[str, Any] = {
            "summary": summary, "operationId": f"{method}_{path.strip('/').replace('/', '_')}",
            "responses": {"200": {"description": "OK", "content": ok},
                          **{code: _error(text) for code, text in COMMON_ERRORS.items()}}}
        if model is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": names[(model, "validation")]}}}
            op["responses"].update({code: _error(text) for code, text in
                                    GENERATION_ERRORS.items()})
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": version},
            "paths": paths, "components": {"schemas": schemas,
                                           "securitySchemes": {"bearer": {
                                               "type": "http", "scheme": "bearer"}}}}
