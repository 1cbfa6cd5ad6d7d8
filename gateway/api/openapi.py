"""`/openapi.json`: the gateway's OpenAPI 3.1 description, built from the pydantic request
schemas (gateway.http.schemas, and the dialects'), so it cannot drift from what the routes
validate, and completed per request with what only the running server knows.

    the dialect records the app serves (gateway.dialects.served: each endpoint's path, schema,
    formatter and summary; each side route's) + the server's own ROUTES (path, method, request
    model or None, summary) ──pydantic models_json_schema──▶ components.schemas + one operation
    per route, each with its error responses, in its dialect's shape  (once)
    server_figures(config, registry): the served model names, their vocabulary and context,
        the configured limits ──with_figures──▶ each `server_bound` of a field filled in
        (per request; rendered again only when a figure changed: a model joined or left)

The rules across fields that the routes check after pydantic are in the models' schemas too
(gateway.http.request_rules). What no schema can say (a prompt's length in tokens, whether a grammar
compiles, a deadline too short for this request on this server) is in the fields'
descriptions. A timeout's least is not stated though the workers' speed is measured: the least
request's time is no bound for a longer one, and a timeout drawn at that edge is admitted and
then missed (a 504) as often as refused.

Response bodies are described loosely (an object; an SSE stream for streams) except the error
shape, which every route shares: {"error": {"message", "type", "param", "code"}}, and the answer
of POST /models/load and /models/unload ({"model", "status"}). Those two are in the document only
where the gateway serves them (`kestrel serve --models-dir`: an on-demand pool); elsewhere they
answer 404, which a document naming them would contradict.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.config import GatewayConfig
from gateway.dialects import anthropic
from gateway.dialects.record import Dialect
from gateway.dialects.served import DIALECTS
from gateway.engine.on_demand import STATUSES
from gateway.engine.registry import Registry
from gateway.http.schemas import SERVER_BOUND, DetokenizeRequest, ModelRequest, TokenizeRequest

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

DESCRIPTION = ("The bounds that depend on this server (the served models' names, vocabulary and "
               "context, its configured limits) are the ones in force when this document is "
               "fetched.")

# The server's own routes (the dialects' come from their records): path, method, request model
# (or None), summary.
ROUTES: list[tuple[str, str, type[BaseModel] | None, str]] = [
    ("/tokenize", "post", TokenizeRequest, "a prompt's or a chat's token ids (vLLM's shape)"),
    ("/detokenize", "post", DetokenizeRequest, "the text of token ids (vLLM's shape)"),
    ("/v1/models", "get", None, "the models the ready workers serve"),
    ("/health", "get", None, "status, workers and queue (503 when not ready)"),
    ("/health/live", "get", None, "the process answers"),
    ("/health/ready", "get", None, "ready for work (503 otherwise)"),
    ("/metrics", "get", None, "Prometheus metrics"),
    ("/v1/metrics", "get", None, "Prometheus metrics"),
    ("/openapi.json", "get", None, "this document"),
]
# Anthropic's token count (gateway.api.tokenize_routes), in the Messages API's error shape
COUNT_TOKENS = ("/v1/messages/count_tokens", anthropic.CountTokensRequest,
                "Anthropic's token count of a Messages request")
# `kestrel serve --models-dir` only (gateway.api.app), each with the statuses it answers besides
# 200: the key and the rate limit (Auth.guard), the body as read_json reads it, and its own.
MODEL_STATUS = {"type": "object", "required": ["model", "status"],
                "properties": {"model": {"type": "string"}, "status": {"enum": list(STATUSES)}}}
MODEL_ERRORS = {"401": COMMON_ERRORS["401"], "429": "rate limited (see Retry-After)",
                "403": "API keys are set and this key is not in --admin-keys (admin_key_required)",
                "400": "the body is not valid JSON", "408": "the body did not arrive in time",
                "413": "the body is too large", "422": "the body is not {\"model\": ID}",
                "404": "the model is not in the models folder (model_not_found)"}
# path, summary, its own errors
MODEL_ROUTES: list[tuple[str, str, dict[str, str]]] = [
    ("/models/load", "start a model's worker (if it is not loaded) and wait until it serves",
     {"503": "the model failed to load (model_load_failed, naming why), or shutting down"}),
    ("/models/unload", "stop a model's worker (a worker of another host is left serving)",
     {"409": "the model has requests, queued, running or waiting for it to load (model_busy): "
             "it is never unloaded under them", "503": "shutting down"}),
]


def _error(text: str, shape: str = "Error") -> dict[str, Any]:
    return {"description": text,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=shape)}}}}


def build_openapi(title: str = "kestrel", version: str = "0.1.0", on_demand: bool = False,
                  dialects: Sequence[Dialect] = DIALECTS) -> dict[str, Any]:
    """The document of the server serving `dialects`; `on_demand`: with the routes that load
    and unload models by hand."""
    endpoints = [(dialect, e) for dialect in dialects for e in dialect.endpoints]
    models = [(model, "validation") for model in (
        *(e.route.schema for _, e in endpoints), COUNT_TOKENS[1],
        *(model for _, _, model, _ in ROUTES if model is not None),
        *((ModelRequest,) if on_demand else ()))]
    names, defs = models_json_schema(models, ref_template=REF)
    schemas: dict[str, Any] = {**defs.get("$defs", {}), "Error": ERROR,
                               "AnthropicError": anthropic.ERROR_SCHEMA}
    schemas.update(dialect.error_schema for dialect in dialects if dialect.error_schema)
    paths: dict[str, Any] = {}
    for dialect, e in endpoints:
        shape, fmt = _shape(dialect), e.formatter
        paths[e.path] = {"post": _operation(
            e.path, "post", names[(e.route.schema, "validation")], e.summary,
            None if e.route.stream is False else fmt.media_type.split(";")[0], shape,
            lambda status, fmt=fmt: fmt.error_shape(status, "", None, None)[0])}
    for dialect in dialects:
        for side in dialect.side_routes:
            if side.summary is not None:
                method = side.method.lower()
                paths[side.path] = {method: _operation(side.path, method, None, side.summary,
                                                       None, _shape(dialect))}
    path, model, summary = COUNT_TOKENS
    paths[path] = {"post": _operation(path, "post", names[(model, "validation")], summary, None,
                                      "AnthropicError", anthropic.error_status)}
    for path, method, model, summary in ROUTES:
        schema = None if model is None else names[(model, "validation")]
        paths.setdefault(path, {})[method] = _operation(path, method, schema, summary, None)
    if on_demand:
        schemas["ModelStatus"] = MODEL_STATUS
        for path, summary, errors in MODEL_ROUTES:
            paths[path] = {"post": _model_operation(path, names[(ModelRequest, "validation")],
                                                    summary, errors)}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version,
                                         "description": DESCRIPTION},
            "paths": paths, "components": {"schemas": schemas,
                                           "securitySchemes": {"bearer": {
                                               "type": "http", "scheme": "bearer"}}}}


def _shape(dialect: Dialect) -> str:
    """The name of the dialect's error body in the document."""
    return dialect.error_schema[0] if dialect.error_schema else "Error"


def _operation(path: str, method: str, schema: dict[str, Any] | None, summary: str,
               stream: str | None, shape: str = "Error",
               status_of: Callable[[int], int] = lambda status: status) -> dict[str, Any]:
    """One route: its request body's schema (None: no body), its answers: JSON, and `stream`
    (a media type) where it may stream; errors in `shape`, each status the route answers
    (`status_of`: the status it answers for the gateway's, as its dialect maps them)."""
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if path.endswith("metrics"):
        ok = {"text/plain": {"schema": {"type": "string"}}}
    if stream is not None:
        ok[stream] = {"schema": {"type": "string"}}
    op: dict[str, Any] = {
        "summary": summary, "operationId": f"{method}_{path.strip('/').replace('/', '_')}",
        "responses": {"200": {"description": "OK", "content": ok},
                      **{code: _error(text, shape) for code, text in COMMON_ERRORS.items()}}}
    if schema is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": schema}}}
        op["responses"].update({code: _error(text, shape) for code, text in
                                GENERATION_ERRORS.items() if status_of(int(code)) == int(code)})
    return op


def _model_operation(path: str, schema: dict[str, Any], summary: str,
                     errors: dict[str, str]) -> dict[str, Any]:
    """POST /models/load or /models/unload: {"model": id} in, the model's status out."""
    ok = {"application/json": {"schema": {"$ref": REF.format(model="ModelStatus")}}}
    return {"summary": summary, "operationId": f"post_{path.strip('/').replace('/', '_')}",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": schema}}},
            "responses": {"200": {"description": "the model's status now", "content": ok},
                          **{code: _error(text) for code, text in
                             {**MODEL_ERRORS, **errors}.items()}}}


def server_figures(cfg: GatewayConfig, registry: Registry) -> dict[str, Any]:
    """The figures the routes check requests against on this server now, by the names
    gateway.http.schemas.server_bound gives them; those of the models absent while none is
    served."""
    figures: dict[str, Any] = {"max_prompt_chars": cfg.max_prompt_chars,
                               "max_prompt_ids": cfg.max_prompt_chars,
                               "max_tokens": cfg.max_tokens_cap}
    models = list(registry.models.values())
    if models:
        names = [name for e in models for name in (e.model_id, *e.hello.aliases)]
        figures["model"] = [None, "", *dict.fromkeys(names)]  # absent or "": the first model
        figures["vocab_size"] = max(e.tokenizer.vocab_size for e in models)
        figures["token_id_pattern"] = integers_below(figures["vocab_size"])
        # A prompt has at least one token, and with max_tokens it must fit the context.
        context = max(e.hello.max_model_len for e in models)
        figures["max_tokens"] = max(1, min(cfg.max_tokens_cap, context - 1))
        figures["max_prompt_ids"] = max(1, min(cfg.max_prompt_chars, context - 1))
        sizes = sorted({e.hello.embedding_size for e in models if e.hello.embedding_size})
        figures["embedding_sizes"] = sizes or None  # a vector's size is the model's own
    return figures


def integers_below(n: int) -> str:
    """A regex of the decimal integers 0 .. n-1 written without leading zeros (n >= 1): a map
    keyed by token ids (logit_bias) can bound its keys only by pattern."""
    top = str(n - 1)
    alternatives = ["0"]
    if len(top) > 1:  # every number with fewer digits than n - 1
        alternatives.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    for i, digit in enumerate(top):  # same length: below n - 1 from digit i on
        low = 1 if i == 0 else 0
        if int(digit) > low:
            alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    alternatives.append(top)
    return "^(" + "|".join(dict.fromkeys(alternatives)) + ")$"


def with_figures(node: Any, figures: dict[str, Any]) -> Any:
    """A copy of `node` with every server bound filled in from `figures`, and its marker gone.
    A bound whose figure is unknown is left out; a figure never loosens a static upper bound."""
    if isinstance(node, list):
        return [with_figures(item, figures) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: with_figures(value, figures) for key, value in node.items()
           if key != SERVER_BOUND}
    for keyword, name in node.get(SERVER_BOUND, {}).items():
        value = figures.get(name)
        if value is None:
            continue
        if keyword in out and keyword.startswith(("max", "exclusiveMax")):
            value = min(out[keyword], value)
        out[keyword] = value
    return out


class OpenAPIDocument:
    """The document's schemas built once; its body rendered again when a figure changes."""

    def __init__(self, dialects: Sequence[Dialect] = DIALECTS, title: str = "kestrel",
                 version: str = "0.1.0", on_demand: bool = False) -> None:
        self.base = build_openapi(title, version, on_demand, dialects)
        self._figures: dict[str, Any] | None = None
        self._body = b""

    def render(self, figures: dict[str, Any]) -> bytes:
        if figures != self._figures:
            self._body = json.dumps(with_figures(self.base, figures)).encode()
            self._figures = figures
        return self._body
