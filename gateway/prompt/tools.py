"""Tool calling: a request's tools into the prompt, a grammar for its tool_choice, calls back out.

    request (tools, tool_choice, messages with tool_calls / role "tool")
      ──ToolPlan.from_request──▶ the plan: which tools may be called, and in which prompt format
      ──prompt──▶ native: template_messages + template_tools, passed to the model's own template
                  generic: render_messages, plain turns with our tools prompt in the system turn
      ──ToolPlan.lark──▶ a grammar (gateway.prompt.structured validates it; the worker enforces it)
    output text ──ToolPlan.message──▶ content + message.tool_calls + finish_reason "tool_calls"
    streamed text ──ToolPlan.stream().feed──▶ content deltas, then tool_calls deltas
    (both through gateway.prompt.tool_calls, which parses `<tool_call>` blocks)

Two prompt formats, one call format. **Native**: the model's chat template has a tools branch
that asks for `<tool_call>` blocks (Qwen2.5's; `GatewayTokenizer.native_tools`): the tools go to
the template as transformers passes them, and the history (assistant tool_calls, `tool` turns)
is rendered by the template too, with each call's arguments as a mapping, as transformers hands
them (Qwen2.5's template writes `tool_call.arguments | tojson`: a JSON string would be quoted
twice). **Generic**, for templates without one (SmolLM2's): the tools go at the end of the system
message as

    # Tools
    You may call a function. The functions, one JSON object per line:
    <tools>
    {"type":"function","function":{"name":...,"description":...,"parameters":{...}}}
    </tools>
    To call a function, reply with only:
    <tool_call>
    {"name":<function name>,"arguments":<arguments as a JSON object>}
    </tool_call>

an assistant turn that called tools is rendered as that same `<tool_call>` block, and a `tool`
message as a user turn `The result of <function name>: <content>` (the name found through its
tool_call_id). SmolLM2 never saw a "tool" role or a `<tool_response>` tag: given either, it
echoes the result back; given a user turn in words, it answers from it.

Constraints: `required` and a named function allow only calls, their arguments constrained by
the tool's JSON schema (an object with listed properties gets no others unless its schema sets
additionalProperties). `auto` allows either free text that does not begin with "<", or calls:
the model chooses with its first token, and once it writes `<tool_call>` the rest is constrained
like `required` (free text is free: a call written later in it, or as bare JSON, is still read
as a call, unconstrained). `none` renders no tools and constrains nothing. The JSON is written
the way the model was shown it: natively `{"name": "f", "arguments": {"a": 1}}` (", " and ": ",
as the template's `tojson` writes the history), generically compact. How many calls: natively,
with `auto` and `required`, one or more, one per line (Qwen2.5's template says "one or more"),
one when parallel_tool_calls is false or a function is named; generically, one per turn. Where
the tokenizer has `<tool_call>` as one added token (Qwen2.5's), the grammar allows that token:
to llguidance an added token is only its id, never the text it spells.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.http.errors import APIError
from gateway.http.output_schemas import NamedToolChoice, Tool
from gateway.prompt.tool_calls import CLOSE, OPEN, CallStream, parse_calls
from gateway.tokens.tokenizer import GatewayTokenizer

_COMPACT = {"whitespace_flexible": False}
# How Qwen2.5's template writes a call, and Python's json.dumps (jinja's tojson) any JSON.
_SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _tool_json(tool: Tool) -> str:
    fn = tool.function
    body: dict[str, Any] = {"name": fn.name}
    if fn.description:
        body["description"] = fn.description
    body["parameters"] = fn.parameters if fn.parameters is not None else {"type": "object"}
    return json.dumps({"type": "function", "function": body}, ensure_ascii=False)


def tools_prompt(tools: list[Tool]) -> str:
    lines = "\n".join(_tool_json(t) for t in tools)
    return ("# Tools\nYou may call a function. The functions, one JSON object per line:\n"
            f"<tools>\n{lines}\n</tools>\nTo call a function, reply with only:\n"
            f"{OPEN}\n" '{"name":<function name>,"arguments":<arguments as a JSON object>}'
            f"\n{CLOSE}")


def _call_block(name: str, arguments: Any) -> str:
    return f"{OPEN}\n" + json.dumps({"name": name, "arguments": arguments},
                                    ensure_ascii=False, separators=(",", ":")) + f"\n{CLOSE}"


def _arguments(text: str) -> Any:
    """A call's arguments as sent (JSON text) -> the mapping it holds; text that is not JSON
    stays text: it is what was sent."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def render_messages(messages: list[Any], tools: list[Tool] | None) -> list[dict[str, str]]:
    """Generic: the conversation as plain role/content messages a text-only template renders."""
    out: list[dict[str, str]] = []
    names: dict[str, str] = {}  # tool_call_id -> the function it called
    for msg in messages:
        text = msg.text()
        if msg.role == "tool":
            name = names.get(msg.tool_call_id or "", "the function")
            out.append({"role": "user", "content": f"The result of {name}: {text}"})
            continue
        if msg.role == "assistant" and msg.tool_calls:
            blocks = []
            for call in msg.tool_calls:
                names[call.id] = call.function.name
                blocks.append(_call_block(call.function.name, _arguments(call.function.arguments)))
            text = "\n".join(([text] if text else []) + blocks)
        out.append({"role": msg.role, "content": text})
    if tools:
        prompt = tools_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Native: the conversation as transformers hands it to a template that renders tool calls:
    OpenAI's messages, each call's arguments a mapping; content "" where a message has none
    (templates add it to strings), None only beside tool_calls."""
    out = []
    for msg in messages:
        item = msg.model_dump(exclude_none=True)
        if msg.tool_calls:
            for call in item["tool_calls"]:
                call["function"]["arguments"] = _arguments(call["function"]["arguments"])
        elif msg.content is None:
            item["content"] = ""
        out.append(item)
    return out


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Native: the tools as transformers passes them, {"type": "function", "function": {...}};
    no `strict` (a request flag, not part of the function's description)."""
    return [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in tools]


def closed(schema: Any) -> Any:
    """A copy of a JSON schema whose objects with listed properties admit no others unless they
    say so. JSON Schema allows extra properties by default, and a small model, given the room,
    writes made-up keys (SmolLM2 copied "maxLength" from the prompt into its arguments) until
    max_tokens cuts the call off. Arguments valid here are still valid under the tool's schema."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _call_schema(tools: list[Tool], native: bool) -> dict[str, Any]:
    options = []
    for t in tools:
        params = closed(t.function.parameters) if t.function.parameters is not None \
            else {"type": "object"}
        options.append({"type": "object", "additionalProperties": False,
                        "properties": {"name": {"const": t.function.name}, "arguments": params},
                        "required": ["name", "arguments"]})
    return {"anyOf": options, "x-guidance": _SPACED if native else _COMPACT}


def _tag(text: str, token_id: int | None) -> str:
    """A Lark alternative for a tag: its text, or its added token by id."""
    literal = json.dumps(text)
    return literal if token_id is None else f"{literal} | <[{token_id}]>"


@dataclass
class ToolPlan:
    """What one chat request does with its tools. `mode`: auto, required or named."""

    tools: list[Tool]
    mode: str
    allowed: list[Tool] = field(default_factory=list)  # the tools a call may name
    native: bool = False  # the model's template lays out the tools (module docstring)
    parallel: bool = True  # natively, auto and required may write several calls
    tag_ids: tuple[int | None, int | None] = (None, None)  # OPEN, CLOSE as one added token each

    @classmethod
    def from_request(cls, body: Any, tokenizer: GatewayTokenizer | None = None) -> ToolPlan | None:
        """None when no tool may be called (no tools, or tool_choice "none"); 400 on a choice
        that names a missing tool or that needs tools the request does not give. `tokenizer`:
        the model's (None: the generic format, tags as text)."""
        tools, choice = body.tools or [], body.tool_choice
        if not tools:
            if choice is not None and choice != "none":
                raise APIError(400, "tool_choice needs tools", param="tool_choice",
                               code="invalid_value")
            return None
        choice = "auto" if choice is None else choice
        if choice == "none":
            return None
        how: dict[str, Any] = {"parallel": body.parallel_tool_calls is not False}
        if tokenizer is not None:
            how.update(native=tokenizer.native_tools, tag_ids=(
                tokenizer.added_token_id(OPEN), tokenizer.added_token_id(CLOSE)))
        if isinstance(choice, NamedToolChoice):
            named = [t for t in tools if t.function.name == choice.function.name]
            if not named:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not "
                               "among the tools", param="tool_choice", code="invalid_value")
            return cls(tools, "named", named[:1], **how)
        return cls(tools, choice, list(tools), **how)

    def lark(self) -> str:
        """The Lark grammar (llguidance's dialect, %json for the arguments) for this plan."""
        schema = json.dumps(_call_schema(self.allowed, self.native))
        several = self.native and self.parallel and self.mode != "named"
        rules = (("calls: call (\"\\n\" call)*\n" if several else "calls: call\n")
                 + 'call: open "\\n" body "\\n" close\n'
                 + f"open: {_tag(OPEN, self.tag_ids[0])}\nclose: {_tag(CLOSE, self.tag_ids[1])}\n"
                 + f"body: %json {schema}\n")
        if self.mode == "auto":
            # Free text may not begin with "<": a "<" first is the start of a call.
            return "start: (TEXT | calls)?\nTEXT: /[^<][\\s\\S]*/\n" + rules
        return "start: calls\n" + rules

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.allowed}

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The choice's message and finish reason, tool calls parsed out where there are."""
        parsed = parse_calls(text, self.names)
        if parsed is None:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": parsed.content,
                "tool_calls": parsed.calls}, "tool_calls"

    def stream(self) -> CallStream:
        """One streamed choice's deltas (gateway.prompt.tool_calls)."""
        return CallStream(self.names)
