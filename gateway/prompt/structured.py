"""Structured output at the gateway: a request's constraint -> one validated llguidance grammar.

    body (response_format | guided_json | guided_regex | guided_choice | guided_grammar |
          structured_outputs | the tool plan's grammar)
      ──build──▶ llguidance grammar (a JSON string) ──validate──▶ EngineRequest.grammar ──▶ Generate

At most one source may be set (two would be two contradicting grammars): a second one is a 400.
A bad schema, regex or grammar is a 400 here, at once, before anything is tokenized or queued;
the worker then only builds a matcher from a grammar known to compile. Validation runs in a
thread: a large schema can take milliseconds to compile.

Whitespace is compact by default (`{"a":1,"b":[2,3]}`, no spaces or newlines between tokens):
a small model given the choice often emits whitespace until max_tokens. A schema may ask for
other whitespace with llguidance's own "x-guidance" key, which is applied after our default.

Names follow OpenAI (`response_format`: text, json_object, json_schema with strict) and vLLM
(`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and the newer
`structured_outputs` object with json / regex / choice / grammar / json_object). A grammar is
Lark (llguidance's dialect) or GBNF (llama.cpp's), told apart by GBNF's `::=`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance import LLMatcher, grammar_from

from gateway import offload
from gateway.http.errors import APIError, too_many_requests
from gateway.prompt.grammar_cache import CACHE

COMPACT_JSON: dict[str, Any] = {"whitespace_flexible": False}  # separators "," and ":" only
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def json_grammar(schema: dict[str, Any] | str | bool) -> str:
    """llguidance's grammar for a JSON schema, compact whitespace unless the schema says not."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
    if isinstance(schema, bool):  # JSON Schema allows true / false as a whole schema
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    return LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)  # type: ignore[arg-type]


def lark_or_gbnf_grammar(text: str) -> str:
    return grammar_from("gbnf" if "::=" in text else "lark", text)


def choice_grammar(choices: list[str]) -> str:
    if not choices:
        raise ValueError("guided_choice needs at least one choice")
    return grammar_from("choice", json.dumps(choices))


def _sources(body: Any) -> list[tuple[str, Any]]:
    """(param name, builder input) for every constraint the body sets."""
    found: list[tuple[str, Any]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", ("json", ANY_OBJECT)))
        else:
            js = rf.json_schema
            if js is None:
                raise APIError(400, "response_format of type json_schema needs a json_schema",
                               param="response_format", code="invalid_value")
            found.append(("response_format",
                          ("json", js.schema_ if js.schema_ is not None else ANY_OBJECT)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, (kind, value)))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        set_fields = [(k, getattr(so, k)) for k in ("json", "regex", "choice", "grammar")
                      if getattr(so, k) is not None]
        if so.json_object:
            set_fields.append(("json", ANY_OBJECT))
        if len(set_fields) > 1:
            raise APIError(400, "structured_outputs takes one of json, regex, choice, grammar "
                           "or json_object", param="structured_outputs", code="invalid_value")
        found += [("structured_outputs", (k, v)) for k, v in set_fields]
    return found


def _build(kind: str, value: Any) -> str:
    if kind == "json":
        return json_grammar(value)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return choice_grammar(value)
    if kind == "grammar":
        return lark_or_gbnf_grammar(value)
    if kind == "lark":  # a grammar we built ourselves (tools)
        return LLMatcher.grammar_from_lark(value)
    raise ValueError(f"unknown constraint {kind!r}")


def build_checked(kind: str, value: Any) -> str:
    """The grammar, or ValueError with llguidance's own message if it does not compile."""
    grammar = _build(kind, value)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error.strip())
    return grammar


async def request_grammar(body: Any, tools_lark: str | None = None,
                          client: str | None = None) -> str | None:
    """The one validated grammar for this request (None: free text), or an APIError 400."""
    sources = _sources(body)
    if tools_lark is not None:
        sources.append(("tool_choice", ("lark", tools_lark)))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(dict.fromkeys(name for name, _ in sources))
        raise APIError(400, f"set only one of response_format, guided_*, structured_outputs and "
                       f"a tool_choice that calls tools (got {names})", param=sources[1][0],
                       code="invalid_value")
    if body.ignore_eos:
        raise APIError(400, "ignore_eos cannot be combined with structured output: a finished "
                       "grammar allows only the end of the text", param="ignore_eos",
                       code="invalid_value")
    param, (kind, value) = sources[0]
    try:
        # Compiled once per schema (gateway/prompt/grammar_cache.py), on its own bounded pool with a
        # per-client share (gateway/offload.py): a flood of distinct huge schemas is refused at
        # once, not queued in front of other requests' tokenizing.
        return await CACHE.get(kind, value, lambda: offload.run(
            "grammar", build_checked, kind, value, client=client))
    except offload.Busy as exc:
        raise too_many_requests(str(exc), "server_busy", 1.0) from None
    except ValueError as exc:
        raise APIError(400, f"invalid {param}: {summarize(str(exc))}", param=param,
                       code="invalid_response_format") from None


def summarize(message: str, limit: int = 300) -> str:
    """A library's error as a client may see it: its first line, no build paths; a panic (with
    its backtrace and source locations) is only named, never passed through."""
    if "panicked" in message or "backtrace" in message or re.search(r"\.rs:\d+", message):
        return "the constraint engine could not build this grammar (too large or too complex)"
    lines = message.strip().splitlines()
    first = re.sub(r"(?:/[\w.+@-]+){2,}", "<path>", lines[0] if lines else "rejected")
    return first[:limit]
