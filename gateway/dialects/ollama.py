"""Ollama's API (`/api/chat`, `/api/generate`), as a thin translation onto the chat and
completion routes: its body becomes their request, served by the one intake, admission and
engine path; the answer goes back as Ollama's JSON lines (gateway.dialects.ollama_reply).

    /api/chat     {model, messages (tool_calls, tool), tools, format, options, stream}
                      ──▶ ChatCompletionRequest
    /api/generate {model, prompt, system, suffix, raw, format, options, stream}
                      ──▶ a chat of one user turn (the model's template, as Ollama applies it),
                          or with raw: true, a CompletionRequest of the prompt as it is
    options: temperature, top_p, top_k, num_predict (-1: to the end of the context), stop, seed;
    the rest of Ollama's options (num_ctx, num_thread, ...) are the server's own settings here
    and are ignored, as Ollama ignores the ones a runner does not use
    format: "json" (any JSON object) or a JSON schema ──▶ response_format

Streaming is on unless `"stream": false`, as Ollama's. Errors are {"error": message}.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.http.errors import validated
from gateway.http.output_schemas import Tool
from gateway.http.schemas import (
    MAX_STOP,
    PROMPT_TEXT,
    STOP_TEXT,
    ChatCompletionRequest,
    CompletionRequest,
    server_bound,
)

VERSION = "0.12.0"  # the Ollama API version this server speaks (GET /api/version)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": message}


# That error body's JSON schema, as /openapi.json states it (gateway.dialects.served's record).
ERROR_SCHEMA = {"type": "object", "required": ["error"],
                "properties": {"error": {"type": "string"}}}


class OllamaOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, lt=2**31)] | None = None
    num_predict: Annotated[int, Field(ge=-2, json_schema_extra=server_bound(
        maximum="max_tokens"))] | None = None
    stop: Annotated[list[STOP_TEXT], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None


class OllamaCalledFunction(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: dict[str, Any] = {}


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    function: OllamaCalledFunction


class OllamaMessage(BaseModel):
    """A system, user or tool turn: its text is its content, and not empty."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "tool"]
    content: PROMPT_TEXT
    tool_name: str | None = None  # a tool turn: which tool answered
    tool_calls: None = None


class OllamaAssistantMessage(BaseModel):
    """An assistant turn: its text, or the tools it called (its content then may be empty)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"minLength": 1}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"minItems": 1}}}]})
    role: Literal["assistant"]
    content: str = ""
    tool_calls: list[OllamaToolCall] = []
    tool_name: None = None

    @model_validator(mode="after")
    def _says_something(self) -> OllamaAssistantMessage:
        if not self.content and not self.tool_calls:
            raise ValueError("an assistant turn has content or tool_calls")
        return self


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # keep_alive, think: accepted, not used
    model: Annotated[str | None, Field(json_schema_extra=server_bound(enum="model"))] = None
    format: Literal["json"] | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    stream: bool = True


class OllamaChatRequest(_Request):
    # A format and tools together: the chat route constrains the text to one or the other
    model_config = ConfigDict(extra="ignore", json_schema_extra={
        "not": {"required": ["format", "tools"]}})
    messages: Annotated[list[Annotated[OllamaMessage | OllamaAssistantMessage, Field(
        discriminator="role")]], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None  # OpenAI's shape

    @model_validator(mode="after")
    def _one_constraint(self) -> OllamaChatRequest:
        if self.format is not None and self.tools:
            raise ValueError("format and tools: set one of them")
        return self


class OllamaGenerateRequest(_Request):
    prompt: PROMPT_TEXT
    system: str | None = None
    suffix: str | None = None
    raw: bool = False


def parse_chat(data: Any) -> ChatCompletionRequest:
    body = validated(OllamaChatRequest, data, not_object=400)
    messages: list[dict[str, Any]] = []
    calls_made: list[dict[str, Any]] = []  # the assistant's calls, answered by the tool turns
    for msg in body.messages:
        if msg.role == "assistant" and msg.tool_calls:
            calls = [{"id": f"call_{len(calls_made) + i}", "type": "function",
                      "function": {"name": c.function.name,
                                   "arguments": json.dumps(c.function.arguments)}}
                     for i, c in enumerate(msg.tool_calls)]
            calls_made += calls
            messages.append({"role": "assistant", "content": msg.content or None,
                             "tool_calls": calls})
        elif msg.role == "tool":
            answered = next((c for c in calls_made if msg.tool_name in
                             (None, c["function"]["name"])), None)
            if answered is not None:
                calls_made.remove(answered)
            messages.append({"role": "tool", "content": msg.content,
                             "tool_call_id": answered["id"] if answered else "call_0"})
        else:
            messages.append({"role": msg.role, "content": msg.content})
    chat: dict[str, Any] = {"model": body.model, "messages": messages,
                            **_common(body)}
    if body.tools:
        chat["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    return validated(ChatCompletionRequest, chat)


def parse_generate(data: Any) -> ChatCompletionRequest | CompletionRequest:
    body = validated(OllamaGenerateRequest, data, not_object=400)
    if body.raw:  # the prompt as it is, no template
        out: dict[str, Any] = {"model": body.model, "prompt": body.prompt,
                               **_common(body)}
        if body.suffix:
            out["suffix"] = body.suffix
        return validated(CompletionRequest, out)
    if body.suffix:  # fill in the middle is a raw completion here
        return validated(CompletionRequest, {"model": body.model, "prompt": body.prompt,
                                            "suffix": body.suffix, **_common(body)})
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
        {"role": "user", "content": body.prompt}]
    return validated(ChatCompletionRequest, {"model": body.model, "messages": messages,
                                            **_common(body)})


def _common(body: _Request) -> dict[str, Any]:
    """The sampling fields, the limit, the format and the stream, as the routes name them."""
    out: dict[str, Any] = {"stream": body.stream}
    o = body.options or OllamaOptions()
    for name in ("temperature", "top_p", "top_k", "seed", "stop"):
        if getattr(o, name) is not None:
            out[name] = getattr(o, name)
    if o.num_predict is not None and o.num_predict > 0:  # else to the end of the context
        out["max_tokens"] = o.num_predict
    if body.format == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "response", "schema": body.format}}
    return out
