"""Tool calls as the model writes them: Hermes-style `<tool_call>` blocks, read from a whole
output or from a stream.

    output text ──parse_calls──▶ Parsed: the content before the first block + OpenAI tool_calls,
                                 or None (not tool calls: the text stays the content)
    streamed text ──CallStream.feed──▶ content deltas (the text before the first block, as it
                                 comes), then, when the choice ends, tool_calls deltas

The format, which Qwen2.5's chat template asks for (NousResearch's Hermes 2 Pro introduced it,
vLLM's `hermes` tool parser reads it) and gateway.prompt.tools' own prompt asks for too:

    optional text
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    ...

Rules, in one function so that a streamed and a non-streamed answer say the same thing:
- the content is the text before the first `<tool_call>`, trailing whitespace dropped; None when
  nothing is left;
- each block holds one JSON object: "name", one of the tools the request allows, and "arguments",
  an object (or a string holding one; absent: {}); the last block may lack its `</tool_call>` (a
  model that ends its turn right after the JSON);
- only whitespace between and after the blocks;
- a whole output that is one such JSON object with both keys and no tags is one call too:
  Qwen2.5-Coder, prompted by its own template, writes its calls bare more often than in tags
  (a habit of that model also seen under vLLM, whose hermes parser leaves it as text);
- anything else (JSON that does not parse, an unknown name, a block cut off by max_tokens, text
  after a call) is not tool calls: the whole text is the content, the finish reason unchanged.

Streaming: the text before the first block goes out as it comes, less a tail that may still turn
out to be whitespace before a call or the start of `<tool_call>` itself; from the first
`<tool_call>` on (or from the start, when the output begins with "{": it may be a bare call),
everything is held to the end of the choice, then sent as tool_calls deltas
(for each call one delta with its index, id, type and name, then one with its arguments) or, if
it is not tool calls by the rules above, as one content delta. No tag text reaches a client, and
the joined stream is what the non-streamed answer says. Holding the calls costs little: they are
short, and the model ends its turn right after the last one.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text before the first call
    calls: list[dict[str, Any]]  # OpenAI's tool_calls, at least one


def _call(raw: str, names: Collection[str], bare: bool = False) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    if bare and set(obj) != {"name", "arguments"}:  # untagged: only the exact shape is a call
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(
                args, ensure_ascii=False, separators=(",", ":"))}}


def parse_calls(text: str, names: Collection[str]) -> Parsed | None:
    """The tool calls in a whole output, or None when it is not (only) tool calls."""
    start = text.find(OPEN)
    if start < 0:
        call = _call(text, names, bare=True) if text.lstrip().startswith("{") else None
        return None if call is None else Parsed(None, [call])
    calls, pos = [], start
    for block in _BLOCK.finditer(text, start):
        if text[pos:block.start()].strip():
            return None
        call = _call(block.group(1), names)
        if call is None:
            return None
        calls.append(call)
        pos = block.end()
    if text[pos:].strip():
        return None
    return Parsed(text[:start].rstrip() or None, calls)


def call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's streamed form of whole calls: name first, then the arguments, by index."""
    deltas = []
    for index, call in enumerate(calls):
        fn = call["function"]
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": fn["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index,
                                       "function": {"arguments": fn["arguments"]}}]})
    return deltas


def _partial_open(text: str) -> int:
    """The length of the longest end of `text` that begins OPEN (a tag split across pieces)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


class CallStream:
    """One streamed choice's text, turned into content and tool_calls deltas (see above)."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        # Invariant: `held` is what was not sent yet; what was sent ends in neither whitespace
        # nor a part of OPEN, so the first OPEN of the whole text begins inside `held`.
        self.held = ""
        self.in_calls = False  # `held` begins with whitespace and the first OPEN, or with "{"
        self.sent = False  # some content went out: a bare call can no longer begin

    def feed(self, text: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas to send now, and the finish reason to send with the last of them."""
        self.held += text
        deltas: list[dict[str, Any]] = []
        if not self.in_calls and not self.sent and self.held.lstrip().startswith("{"):
            self.in_calls = True  # maybe a bare call: held whole
        if not self.in_calls:
            start = self.held.find(OPEN)
            self.in_calls = start >= 0
            cut = start if self.in_calls else len(self.held) - _partial_open(self.held)
            cut = len(self.held[:cut].rstrip())
            if cut:
                deltas.append({"content": self.held[:cut]})
                self.held = self.held[cut:]
                self.sent = True
        if finish is None:
            return deltas, None
        if self.in_calls:
            parsed = parse_calls(self.held, self.names)
            if parsed is not None:
                before = [{"content": parsed.content}] if parsed.content else []
                return deltas + before + call_deltas(parsed.calls), "tool_calls"
        if self.held:
            deltas.append({"content": self.held})
            self.held = ""
        return deltas, finish
