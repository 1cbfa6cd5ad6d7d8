"""The rules across a body's fields that the routes check after pydantic, in JSON Schema, so that
/openapi.json states them too (gateway.http.schemas adds them to the request models' schemas; the
routes' own checks, and their 400s, stay where they are):

    gateway.prompt.structured: one constraint at most (response_format other than "text", a guided_*
        field, structured_outputs, or, in a chat, tools that may be called), and none with
        ignore_eos
    gateway.prompt.tools: a tool_choice other than "none" needs tools
    the intake: a chat whose messages have no text at all is an empty prompt (422)
    /tokenize: a prompt or messages, exactly one

What no schema can say is left to the fields' descriptions: whether a regex, grammar or JSON
schema compiles, whether a named tool is among the tools; and continue_final_message's need of
add_generation_prompt false (said in JSON Schema, it left schemathesis unable to draw a chat).
"""

from __future__ import annotations

from typing import Any

NULL: dict[str, Any] = {"type": "null"}
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")

# A chat whose tools may be called: tools given, tool_choice absent or other than "none".
TOOL_PLAN: dict[str, Any] = {"required": ["tools"], "properties": {
    "tools": {"type": "array", "minItems": 1}, "tool_choice": {"not": {"const": "none"}}}}
NO_TOOL_PLAN: dict[str, Any] = {"not": TOOL_PLAN}


def _unset(field: str) -> dict[str, Any]:
    """The field absent or null; response_format also when it asks for plain text."""
    if field == "response_format":
        text = {"properties": {"type": {"const": "text"}}}
        return {"properties": {field: {"anyOf": [NULL, text]}}}
    if field == "tools":
        return NO_TOOL_PLAN
    return {"properties": {field: NULL}}


def one_constraint(chat: bool) -> dict[str, Any]:
    """At most one source of a grammar, and ignore_eos false beside it."""
    sources = ["response_format", *GUIDED, *(["tools"] if chat else [])]
    keep_eos = {"properties": {"ignore_eos": {"const": False}}}
    branches = [{"allOf": [_unset(s) for s in sources]}]
    for source in sources:
        branches.append({"allOf": [_unset(s) for s in sources if s != source] + [keep_eos]})
    return {"anyOf": branches}


# A content with some text: a string, or a list of parts one of which has text.
_TEXT = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "contains": {
    "type": "object", "required": ["text"], "properties": {"text": {"minLength": 1}}}}]}
SOME_TEXT: dict[str, Any] = {"anyOf": [
    {"properties": {"messages": {"contains": {
        "type": "object", "required": ["content"], "properties": {"content": _TEXT}}}}},
    TOOL_PLAN]}  # the tools themselves are prompt text
TOOL_CHOICE_NEEDS_TOOLS: dict[str, Any] = {"anyOf": [
    {"properties": {"tool_choice": {"enum": [None, "none"]}}},
    {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]}

COMPLETION_RULES: dict[str, Any] = {"allOf": [one_constraint(chat=False)]}
CHAT_RULES: dict[str, Any] = {"allOf": [one_constraint(chat=True), TOOL_CHOICE_NEEDS_TOOLS,
                                        SOME_TEXT]}

# /tokenize: a prompt or messages, exactly one (the other absent or null).
TOKENIZE_RULES: dict[str, Any] = {"oneOf": [
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": NULL}},
    {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": NULL}}]}
