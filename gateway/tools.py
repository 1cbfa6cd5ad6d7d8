"""Tool calling for chat models whose template has no tools branch (SmolLM2's has none).

    request (tools, tool_choice, messages with tool_calls / role "tool")
      ──ToolPlan.messages──▶ plain system/user/assistant messages ──chat template──▶ prompt
      ──ToolPlan.lark──▶ a grammar (gateway.structured validates it; the worker enforces it)
    output text ──ToolPlan.parse──▶ message.tool_calls + finish_reason "tool_calls"
    streamed text ──ToolStream.feed──▶ content deltas, or tool_calls deltas with their index

The prompt format (documented in the README): the tools go at the end of the system message as

    # Tools
    You may call a function. The functions, one JSON object per line:
    <tools>
    {"type":"function","function":{"name":...,"description":...,"parameters":{...}}}
    </tools>
    To call a function, reply with only:
    <tool_call>
    {"name":<function name>,"arguments":<arguments as a JSON object>}
    </tool_call>

An assistant turn that called tools is rendered as that same `<tool_call>` block, and a `tool`
message as a user turn `The result of <function name>: <content>` (the name found through its
tool_call_id). SmolLM2 never saw a "tool" role or a `<tool_response>` tag: given either, it
echoes the result back; given a user turn in words, it answers from it.

Constraints: `required` and a named function allow exactly one call, its arguments constrained
by the tool's JSON schema (compact whitespace; an object with listed properties gets no others
unless its schema sets additionalProperties). `auto` allows either free text that does not
begin with "<", or one call: the model chooses with its first token, and once it writes
`<tool_call>` the rest is constrained like `required`. `none` renders no tools and constrains
nothing. One call per turn (parallel_tool_calls is accepted; the grammar allows one call).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import APIError
from gateway.output_schemas import NamedToolChoice, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_COMPACT = {"whitespace_flexible": False}


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


def render_messages(messages: list[Any], tools: list[Tool] | None) -> list[dict[str, str]]:
    """The conversation as plain role/content messages a text-only chat template can render."""
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
                try:
                    args = json.loads(call.function.arguments)
                except ValueError:
                    args = call.function.arguments  # shown verbatim: it is what was sent
                blocks.append(_call_block(call.function.name, args))
            text = "\n".join(([text] if text else []) + blocks)
        out.append({"role": msg.role, "content": text})
    if tools:
        prompt = tools_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


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


def _call_schema(tools: list[Tool]) -> dict[str, Any]:
    options = []
    for t in tools:
        params = closed(t.function.parameters) if t.function.parameters is not None \
            else {"type": "object"}
        options.append({"type": "object", "additionalProperties": False,
                        "properties": {"name": {"const": t.function.name}, "arguments": params},
                        "required": ["name", "arguments"]})
    return {"anyOf": options, "x-guidance": _COMPACT}


@dataclass
class ToolPlan:
    """What one chat request does with its tools. `mode`: auto, required or named."""

    tools: list[Tool]
    mode: str
    allowed: list[Tool] = field(default_factory=list)  # the tools a call may name

    @classmethod
    def from_request(cls, body: Any) -> ToolPlan | None:
        """None when no tool may be called (no tools, or tool_choice "none"); 400 on a choice
        that names a missing tool or that needs tools the request does not give."""
        tools, choice = body.tools or [], body.tool_choice
        if not tools:
            if choice is not None and choice != "none":
                raise APIError(400, "tool_choice needs tools", param="tool_choice",
                               code="invalid_value")
            return None
        choice = "auto" if choice is None else choice
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            named = [t for t in tools if t.function.name == choice.function.name]
            if not named:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not "
                               "among the tools", param="tool_choice", code="invalid_value")
            return cls(tools, "named", named[:1])
        return cls(tools, choice, list(tools))

    def lark(self) -> str:
        """The Lark grammar (llguidance's dialect, %json for the arguments) for this plan."""
        schema = json.dumps(_call_schema(self.allowed))
        call = f'call: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {schema}\n'
        if self.mode == "auto":
            # Free text may not begin with "<": a "<" first is the start of a call.
            return "start: (TEXT | call)?\nTEXT: /[^<][\\s\\S]*/\n" + call
        return "start: call\n" + call

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI tool_calls from the output, or None when it is not (only) tool calls."""
        if not text.lstrip().startswith(OPEN):
            return None
        names = {t.function.name for t in self.allowed}
        calls = []
        for raw in _CALL.findall(text):
            try:
                obj = json.loads(raw)
            except ValueError:
                return None
            if (not isinstance(obj, dict) or obj.get("name") not in names
                    or not isinstance(obj.get("arguments"), dict)):
                return None
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": obj["name"], "arguments": json.dumps(
                              obj["arguments"], ensure_ascii=False, separators=(",", ":"))}})
        leftover = _CALL.sub("", text).strip()
        return calls if calls and not leftover else None

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The choice's message and finish reason, tool calls parsed out where there are."""
        calls = self.parse(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


class ToolStream:
    """One streamed choice: content passes through once it cannot be a call; a call is held
    until the choice ends, then sent as tool_calls deltas (one per call, with its index)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""
        self.is_text = False
        self.is_call = False  # the held text starts with OPEN: no need to look at it again

    def feed(self, text: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas to send now, and the finish reason to send with the last of them."""
        if self.is_text:
            return ([{"content": text}] if text or finish else []), finish
        self.held += text
        if not self.is_call:
            head = self.held.lstrip()
            if head and not (head.startswith(OPEN) or OPEN.startswith(head)):
                self.is_text = True
                return [{"content": self.held}], finish
            self.is_call = head.startswith(OPEN)
        if finish is None:
            return [], None
        calls = self.plan.parse(self.held)
        if calls is None:
            return [{"content": self.held}], finish
        deltas = []
        for index, call in enumerate(calls):
            fn = call["function"]
            deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                           "function": {"name": fn["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index,
                                           "function": {"arguments": fn["arguments"]}}]})
        return deltas, "tool_calls"
