"""`/openapi.json`: the gateway's OpenAPI 3.1 description, built from the pydantic request
schemas (gateway.http.schemas, through the routes' formatters), so it cannot drift from what the
routes validate, and completed per request with what only the running server knows.

    ROUTES (path, method, request model or None, summary) ──pydantic models_json_schema──▶
        components.schemas + one operation per route, each with its error responses  (once)
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
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.config import GatewayConfig
from gateway.dialects.anthropic import CountTokensRequest
from gateway.engine.on_demand import STATUSES
from gateway.engine.registry import Registry
from gateway.http.schemas import SERVER_BOUND, DetokenizeRequest, ModelRequest, TokenizeRequest
from gateway.prompt.intake import ROUTES as INTAKE_ROUTES

REF = "#/components/schemas/{model}"
ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}
ANTHROPIC_ERROR = {  # the Messages routes' errors (gateway.dialects.anthropic)
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
OLLAMA_ERROR = {"type": "object", "required": ["error"],  # Ollama's routes' (gateway.dialects)
                "properties": {"error": {"type": "string"}}}
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

# path, method, request model (or None), summary, streams
ROUTES: list[tuple[str, str, type[BaseModel] | None, str, bool]] = [
    ("/v1/completions", "post", INTAKE_ROUTES["completions"].schema,
     "OpenAI text completion (stream: true for SSE)", True),
    ("/v1/chat/completions", "post", INTAKE_ROUTES["chat"].schema,
     "OpenAI chat completion (stream: true for SSE)", True),
    ("/v1/embeddings", "post", INTAKE_ROUTES["embeddings"].schema,
     "OpenAI embeddings: each input's pooled, normalised last hidden states", False),
    ("/v1/generate", "post", INTAKE_ROUTES["generate"].schema, "native generation", False),
    ("/v1/generate/stream", "post", INTAKE_ROUTES["generate_stream"].schema,
     "native generation, streamed as SSE", True),
    ("/v1/responses", "post", INTAKE_ROUTES["responses"].schema,
     "OpenAI's Responses API (stream: true for its SSE events); nothing is kept: "
     "previous_response_id is refused", True),
    ("/v1/messages", "post", INTAKE_ROUTES["messages"].schema,
     "Anthropic's Messages API (stream: true for its SSE events)", True),
    ("/v1/messages/count_tokens", "post", CountTokensRequest,
     "Anthropic's token count of a Messages request", False),
    ("/api/chat", "post", INTAKE_ROUTES["ollama_chat"].schema,
     "Ollama's chat (streamed as JSON lines unless stream: false)", True),
    ("/api/generate", "post", INTAKE_ROUTES["ollama_generate"].schema,
     "Ollama's generate (streamed as JSON lines unless stream: false)", True),
    ("/api/tags", "get", None, "Ollama's list of the models this server can serve", False),
    ("/api/ps", "get", None, "Ollama's list of the models loaded now", False),
    ("/api/version", "get", None, "the Ollama API version this server speaks", False),
    ("/tokenize", "post", TokenizeRequest, "a prompt's or a chat's token ids (vLLM's shape)",
     False),
    ("/detokenize", "post", DetokenizeRequest, "the text of token ids (vLLM's shape)", False),
    ("/v1/models", "get", None, "the models the ready workers serve", False),
    ("/health", "get", None, "status, workers and queue (503 when not ready)", False),
    ("/health/live", "get", None, "the process answers", False),
    ("/health/ready", "get", None, "ready for work (503 otherwise)", False),
    ("/metrics", "get", None, "Prometheus metrics", False),
    ("/v1/metrics", "get", None, "Prometheus metrics", False),
    ("/openapi.json", "get", None, "this document", False),
]
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


def build_openapi(title: str = "kestrel", version: str = "0.1.0",
                  on_demand: bool = False) -> dict[str, Any]:
    """The document; `on_demand`: with the routes that load and unload models by hand."""
    models = [(model, "validation") for _, _, model, _, _ in ROUTES if model is not None]
    if on_demand:
        models.append((ModelRequest, "validation"))
    names, defs = models_json_schema(models, ref_template=REF)
    schemas: dict[str, Any] = {**defs.get("$defs", {}), "Error": ERROR,
                               "AnthropicError": ANTHROPIC_ERROR, "OllamaError": OLLAMA_ERROR}
    paths: dict[str, Any] = {}
    for path, method, model, summary, streams in ROUTES:
        schema = None if model is None else names[(model, "validation")]
        paths.setdefault(path, {})[method] = _operation(path, method, schema, summary, streams)
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


def _operation(path: str, method: str, schema: dict[str, Any] | None, summary: str,
               streams: bool) -> dict[str, Any]:
    """One route of ROUTES: its request body's schema (None: no body), its answers."""
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if path.endswith("metrics"):
        ok = {"text/plain": {"schema": {"type": "string"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    shape = ("AnthropicError" if path.startswith("/v1/messages") else
             "OllamaError" if path.startswith("/api/") else "Error")
    op: dict[str, Any] = {
        "summary": summary, "operationId": f"{method}_{path.strip('/').replace('/', '_')}",
        "responses": {"200": {"description": "OK", "content": ok},
                      **{code: _error(text, shape) for code, text in COMMON_ERRORS.items()}}}
    if schema is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": schema}}}
        op["responses"].update({code: _error(text, shape) for code, text in
                                GENERATION_ERRORS.items()
                                if not (shape == "AnthropicError" and code == "422")})
    if streams and shape == "OllamaError":
        ok["application/x-ndjson"] = ok.pop("text/event-stream")
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

    def __init__(self, title: str = "kestrel", version: str = "0.1.0",
                 on_demand: bool = False) -> None:
        self.base = build_openapi(title, version, on_demand)
        self._figures: dict[str, Any] | None = None
        self._body = b""

    def render(self, figures: dict[str, Any]) -> bytes:
        if figures != self._figures:
            self._body = json.dumps(with_figures(self.base, figures)).encode()
            self._figures = figures
        return self._body
