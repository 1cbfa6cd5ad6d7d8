"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as a thin
translation onto the chat route: its body becomes a chat completion request, which the one
intake, admission and engine path serve; its answer and its errors are rendered back in
Anthropic's shapes (gateway.dialects.anthropic_reply).

    system, messages (text, tool_use, tool_result blocks), max_tokens (required), stop_sequences,
    temperature, top_p, top_k, tools (name, description, input_schema), tool_choice
    (auto, any, tool, none), stream ──to_chat──▶ ChatCompletionRequest
        (a tool_use block: the assistant's tool_calls; a tool_result block: a "tool" message)

Kept out, each refused with a 400 that names it: image and document blocks (no vision here),
extended thinking (`thinking`), server tools (a tool with a `type`, such as web search).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.http.errors import APIError, validated
from gateway.http.output_schemas import FUNCTION_NAME
from gateway.http.schemas import (
    MAX_STOP,
    MAX_TOKENS,
    PROMPT_TEXT,
    STOP_TEXT,
    ChatCompletionRequest,
    server_bound,
)

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                499: "invalid_request_error", 500: "api_error", 502: "api_error",
                503: "overloaded_error", 504: "timeout_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error",
            "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


# That error body's JSON schema, as /openapi.json states it (gateway.dialects.served's record).
ERROR_SCHEMA = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}


def error_status(status: int) -> int:
    """Anthropic answers a body that does not validate with 400, where OpenAI's routes say 422."""
    return 400 if status == 422 else status


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: accepted, not used


class AnthropicTextBlock(_Block):
    type: Literal["text"]
    text: PROMPT_TEXT  # Anthropic's API refuses an empty one too


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[AnthropicTextBlock] = ""
    is_error: bool = False


# What a block may say it is: the others are named in a 400 before validation
BLOCK_TYPES = ("text", "tool_use", "tool_result")
_TEXT = PROMPT_TEXT  # not empty, and at most the server's prompt characters


class AnthropicUserMessage(_Block):
    role: Literal["user"]
    content: _TEXT | Annotated[list[Annotated[AnthropicTextBlock | ToolResultBlock, Field(
        discriminator="type")]], Field(min_length=1)]


class AnthropicAssistantMessage(_Block):
    role: Literal["assistant"]
    content: _TEXT | Annotated[list[Annotated[AnthropicTextBlock | ToolUseBlock, Field(
        discriminator="type")]], Field(min_length=1)]


Message = Annotated[AnthropicUserMessage | AnthropicAssistantMessage, Field(discriminator="role")]


class AnthropicTool(_Block):
    name: FUNCTION_NAME  # as the chat route's tools name theirs
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceMode(_Block):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Block):
    type: Literal["tool"]
    name: FUNCTION_NAME
    disable_parallel_tool_use: bool = False


ToolChoice = Annotated[ToolChoiceMode | ToolChoiceTool, Field(discriminator="type")]


class MessagesRequest(BaseModel):
    """POST /v1/messages, as Anthropic's API types it (unknown fields ignored, as theirs are
    not all ours: metadata, service_tier)."""

    model_config = ConfigDict(extra="ignore")
    model: Annotated[str | None, Field(json_schema_extra=server_bound(enum="model"))] = None
    max_tokens: MAX_TOKENS  # at most the server's cap, which /openapi.json states
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[AnthropicTextBlock] | None = None
    stop_sequences: Annotated[list[STOP_TEXT], Field(max_length=MAX_STOP)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1, lt=2**31)] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    stream: bool = False
    timeout: Annotated[float, Field(gt=0.0)] | None = None  # ours, as on every route


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages body without max_tokens."""

    max_tokens: Annotated[int, Field(ge=1)] = 1


def refuse_unsupported(data: Any) -> None:
    """A 400 that names what this server does not serve, in place of the schema's own errors
    (or of its silence: `thinking` is a field it ignores). Run once the schema has had the body
    (parse), and reads no value before checking its type: any JSON gets a 4xx."""
    if not isinstance(data, dict):
        return
    if data.get("thinking") is not None:
        raise APIError(400, "thinking: extended thinking is not supported here",
                       param="thinking", code="unsupported_parameter")
    tools, messages = data.get("tools"), data.get("messages")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
            raise APIError(400, f"tools.{i}.type: server tools ({tool['type']!r}) are not "
                           "supported here; only tools with an input_schema",
                           param=f"tools.{i}.type", code="unsupported_parameter")
    for i, msg in enumerate(messages if isinstance(messages, list) else []):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                raise APIError(400, f"messages.{i}.content.{j}.type: {kind!r} blocks are not "
                               f"supported here (only {', '.join(BLOCK_TYPES)})",
                               param=f"messages.{i}.content.{j}.type",
                               code="unsupported_parameter")


def parse(schema: type[MessagesRequest], data: Any) -> ChatCompletionRequest:
    """The body, validated in Anthropic's terms, as the chat request it asks for. The schema
    first, then what it does not serve named (the clearer 400 where both refuse it)."""
    try:
        body = validated(schema, data, not_object=400)
    except APIError:
        refuse_unsupported(data)
        raise
    refuse_unsupported(data)
    return validated(ChatCompletionRequest, to_chat(body))  # the chat route's bounds too


def _text(content: str | list[AnthropicTextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def to_chat(body: MessagesRequest) -> dict[str, Any]:
    """The chat completion body `body` asks for (a dict, validated by the caller)."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    for msg in body.messages:
        if isinstance(msg.content, str):
            messages.append({"role": msg.role, "content": msg.content})
            continue
        text = "".join(b.text for b in msg.content if isinstance(b, AnthropicTextBlock))
        if msg.role == "assistant":
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in msg.content if isinstance(b, ToolUseBlock)]
            messages.append({"role": "assistant", "content": text or None,
                             **({"tool_calls": calls} if calls else {})})
            continue
        for b in msg.content:  # a user turn: the tool results first, as the calls were made
            if isinstance(b, ToolResultBlock):
                result = _text(b.content)
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                 "content": f"Error: {result}" if b.is_error else result})
        if text or not any(isinstance(b, ToolResultBlock) for b in msg.content):
            messages.append({"role": "user", "content": text})
    chat: dict[str, Any] = {"model": body.model, "messages": messages,
                            "max_tokens": body.max_tokens, "stream": body.stream}
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    for name in ("temperature", "top_p", "top_k", "timeout"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in body.tools]
    choice = body.tool_choice
    if choice is not None and body.tools:  # (without tools there is nothing to choose from)
        chat["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if isinstance(choice, ToolChoiceTool) else
                               {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    return chat
