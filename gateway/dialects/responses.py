"""OpenAI's Responses API (`POST /v1/responses`), as a thin translation onto the chat route: its
body becomes a chat completion request, which the one intake, admission and engine path serve;
its answer goes back as a response object and its stream as the Responses events
(gateway.dialects.responses_reply). Errors keep OpenAI's shape, as on the chat route.

    instructions, input (a string, or messages and items), max_output_tokens, temperature,
    top_p, tools (function tools: name, description, parameters, strict), tool_choice
    (auto, none, required, {"type": "function", "name"}), parallel_tool_calls, text.format
    (text, json_object, json_schema), top_logprobs, stream ──to_chat──▶ ChatCompletionRequest
        instructions: a system message first; a "developer" message: a system one
        a function_call item: a call of the assistant turn before it (or of a new one)
        a function_call_output item: a "tool" message answering its call_id

Nothing is kept between requests here, so whatever needs a kept response is refused with a 400
that names it (previous_response_id, conversation, a stored prompt, background); `store` is
accepted, whatever its value, and every response says `"store": false`. Other tools than
functions (web_search, file_search, computer_use_preview, local_shell, custom, mcp, ...) and
other input than text (input_image, input_file, reasoning items, item references) are refused
with a 400 that names them, before the schema's own errors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
)

from gateway.http.errors import APIError, validated
from gateway.http.output_schemas import FUNCTION_NAME
from gateway.http.request_rules import TOOL_PLAN
from gateway.http.schemas import (
    LOGPROBS,
    MAX_TOKENS,
    PROMPT_TEXT,
    ChatCompletionRequest,
    server_bound,
)

ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text")
# What a kept response would be needed for: refused, each with what to do instead
NOT_KEPT = {
    "previous_response_id": "responses are not kept here: send the whole conversation in input",
    "conversation": "conversations are not kept here: send the whole conversation in input",
    "prompt": "stored prompts are not kept here: send the instructions and input themselves",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The chat route's names of the fields its errors name, as this dialect names them
PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
          "response_format": "text.format"}


class _Item(BaseModel):
    # id, status, annotations, logprobs (an earlier response's output sent back): not used
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class ResponsesInputText(_Item):
    type: Literal["input_text", "output_text"]
    text: PROMPT_TEXT


_TEXT = PROMPT_TEXT | Annotated[list[ResponsesInputText], Field(min_length=1)]


class ResponsesMessage(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: _TEXT


class ResponsesFunctionCall(_Item):
    """A call the model made (an earlier response's output item, sent back)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    arguments: str  # JSON text, as OpenAI sends it


class ResponsesFunctionCallOutput(_Item):
    """A call's result, which the client computed."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    output: str | Annotated[list[ResponsesInputText], Field(min_length=1)]


_ITEMS = {"message": ResponsesMessage, "function_call": ResponsesFunctionCall,
          "function_call_output": ResponsesFunctionCallOutput}


def _item_type(value: Any) -> Any:
    """The model of an item, by its `type` (a message may leave it out: OpenAI's "easy" input
    message); named by its class, which errors leave out of the field's path."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(
        value, "type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    return None if model is None else model.__name__


Item = Annotated[Annotated[ResponsesMessage, Tag(ResponsesMessage.__name__)]
                 | Annotated[ResponsesFunctionCall, Tag(ResponsesFunctionCall.__name__)]
                 | Annotated[ResponsesFunctionCallOutput,
                             Tag(ResponsesFunctionCallOutput.__name__)],
                 Discriminator(_item_type, custom_error_type="invalid_item",
                               custom_error_message="an item's type is one of "
                               + ", ".join(ITEM_TYPES))]


class ResponsesFunctionTool(_Item):
    type: Literal["function"]
    name: FUNCTION_NAME  # as the chat route's tools name theirs
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments are held to `parameters` either way here


class ResponsesNamedFunction(_Item):
    type: Literal["function"]
    name: FUNCTION_NAME


class ResponsesFormatText(_Item):
    type: Literal["text"]


class ResponsesFormatJsonObject(_Item):
    type: Literal["json_object"]


class ResponsesFormatJsonSchema(_Item):
    type: Literal["json_schema"]
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema; the JSON key stays "schema".
    schema_: dict[str, Any] = Field(alias="schema", description=(
        "must compile as a grammar (400 invalid_response_format)"))
    strict: bool | None = None  # constrained either way: a schema is always enforced here


class ResponsesTextConfig(_Item):
    format: Annotated[ResponsesFormatText | ResponsesFormatJsonObject | ResponsesFormatJsonSchema,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not used


_OBJECT = {"type": "object"}
# A format other than text beside tools that may be called: the chat route constrains the text
# to one of them (400), so the document says so.
_CONSTRAINED = {"type": "object", "required": ["text"], "properties": {"text": {
    **_OBJECT, "required": ["format"], "properties": {"format": {
        **_OBJECT, "required": ["type"], "properties": {"type": {
            "enum": ["json_object", "json_schema"]}}}}}}}
RULES: dict[str, Any] = {"allOf": [
    {"not": {"allOf": [_CONSTRAINED, TOOL_PLAN]}},
    # a choice that calls tools needs them ("auto" and "none" without tools: nothing to call)
    {"anyOf": [{"properties": {"tool_choice": {"enum": [None, "none", "auto"]}}},
               {"required": ["tools"], "properties": {"tools": {"type": "array",
                                                                "minItems": 1}}}]}]}


class ResponsesRequest(BaseModel):
    """POST /v1/responses, as OpenAI's API types it (unknown fields ignored, as theirs are not
    all ours: reasoning, service_tier, prompt_cache_key, safety_identifier, ...)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=RULES)
    model: Annotated[str | None, Field(json_schema_extra=server_bound(enum="model"))] = None
    input: PROMPT_TEXT | Annotated[list[Item], Field(min_length=1)]
    instructions: Annotated[str, Field(json_schema_extra=server_bound(
        maxLength="max_prompt_chars"))] | None = None
    max_output_tokens: MAX_TOKENS | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[ResponsesFunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    top_logprobs: LOGPROBS | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool | None = False
    store: Annotated[bool | None, Field(description=(
        "accepted; nothing is kept here, and the response says store false"))] = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: str | None = None
    truncation: Annotated[Literal["auto", "disabled"] | None, Field(description=(
        "a conversation past the context is refused either way (400 "
        "context_length_exceeded)"))] = None
    previous_response_id: Annotated[None, Field(description=(
        "responses are not kept here: any id is refused (400 unsupported_parameter)"))] = None
    conversation: Annotated[None, Field(description=(
        "conversations are not kept here: refused (400 unsupported_parameter)"))] = None
    prompt: Annotated[None, Field(description=(
        "stored prompts are not kept here: refused (400 unsupported_parameter)"))] = None
    background: Annotated[Literal[False] | None, Field(description=(
        "true is refused (400 unsupported_parameter): a response runs while its request is "
        "open"))] = None
    timeout: Annotated[float, Field(gt=0.0)] | None = None  # ours, as on every route


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses body asks for, carrying that body: its answer echoes it."""

    responses: ResponsesRequest = Field(exclude=True)


def refuse_unsupported(data: Any) -> None:
    """A 400 that names what this server does not serve, in place of the schema's own errors
    (or of its silence: previous_response_id... are fields it ignores). Run once the schema has
    had the body (parse); reads no value before checking its type."""
    if not isinstance(data, dict):
        return
    for name, why in NOT_KEPT.items():
        if data.get(name) is not None:
            raise _unsupported(name, why)
    if data.get("background") is True:
        raise _unsupported("background", "background responses are not served here: a "
                           "response runs while its request is open")
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise _unsupported(f"tools.{i}.type", f"{kind!r} tools are not supported here; "
                               "only function tools")
    choice = data.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise _unsupported("tool_choice.type", f"a tool_choice of type {kind!r} is not supported "
                           "here; only auto, none, required or a function")
    items = data.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if isinstance(kind, str) and kind not in ITEM_TYPES:
            raise _unsupported(f"input.{i}.type", f"{kind!r} items are not supported here "
                               f"(only {', '.join(ITEM_TYPES)})")
        for field in ("content", "output"):
            parts = item.get(field)
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in PART_TYPES:
                    raise _unsupported(f"input.{i}.{field}.{j}.type", f"{kind!r} content is "
                                       f"not supported here (only {', '.join(PART_TYPES)})")


def _unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def parse(data: Any) -> ResponsesChatRequest:
    """The body, validated in the Responses API's terms, as the chat request it asks for. The
    schema first, then what it does not serve named (the clearer 400 where both refuse it)."""
    try:
        body = validated(ResponsesRequest, data)
    except APIError:
        refuse_unsupported(data)
        raise
    refuse_unsupported(data)
    # the chat route's bounds too (the prompt's size, ...)
    return validated(ResponsesChatRequest, {**to_chat(body), "responses": body})


def chat_param(param: str | None) -> str | None:
    """A chat route's error's field, as this dialect names it (messages.2.content: input)."""
    if param is None:
        return None
    return PARAMS.get(param.split(".")[0], param)


def _text(content: str | list[ResponsesInputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def to_chat(body: ResponsesRequest) -> dict[str, Any]:
    """The chat completion body `body` asks for (a dict, validated by the caller)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = ([ResponsesMessage(role="user", content=body.input)] if isinstance(body.input, str)
             else body.input)
    for item in items:
        if isinstance(item, ResponsesFunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the turn that made the call
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, ResponsesFunctionCallOutput):
            messages.append({"role": "tool", "content": _text(item.output),
                             **({"tool_call_id": item.call_id} if item.call_id else {})})
        else:  # templates know a system turn; a developer turn is one (OpenAI's reading)
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": _text(item.content)})
    chat: dict[str, Any] = {"model": body.model, "messages": messages,
                            "stream": bool(body.stream)}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p", "timeout", "parallel_tool_calls"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, ResponsesNamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None and (body.tools or choice == "required"):
        chat["tool_choice"] = choice  # (auto or none without tools: nothing to call)
    fmt = body.text.format if body.text else None
    if isinstance(fmt, ResponsesFormatJsonObject):
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, ResponsesFormatJsonSchema):
        chat["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            by_alias=True, exclude={"type"}, exclude_none=True)}
    if body.top_logprobs is not None or LOGPROBS_INCLUDE in (body.include or []):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.top_logprobs or 0
    return chat
