"""gateway/dialects/anthropic*.py alone: a Messages body into the chat request it asks for
(golden translations, refusals), and a chat answer from the fake engine next door back into
Anthropic's message and its stream events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.dialects import anthropic
from gateway.dialects.anthropic_reply import MessagesFormatter
from gateway.http.errors import APIError
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import messages as m
from tests.gateway.fake_engine import ROUTES, answered, streamed, whole

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def chat_of(body: dict[str, Any]) -> dict[str, Any]:
    return ROUTES["messages"].parse(body).model_dump(exclude_unset=True)  # type: ignore[misc]


def test_a_conversation_with_tools_becomes_the_chat_request_it_asks_for() -> None:
    body = {
        "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["\n\n"], "top_k": 5, "temperature": 0.5, "stream": True,
        "tools": [WEATHER], "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "22 C"}]},
                {"type": "text", "text": "And so?"}]},
        ]}
    chat = chat_of(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "22 C"},
        {"role": "user", "content": "And so?"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER["input_schema"]}}]
    assert (chat["tool_choice"], chat["max_tokens"], chat["stop"]) == ("required", 64, ["\n\n"])
    assert (chat["top_k"], chat["temperature"], chat["stream"]) == (5, 0.5, True)


@pytest.mark.parametrize("choice, chat", [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"), ({"type": "any"}, "required"),
    ({"type": "tool", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice_maps_to_the_chat_routes_names(choice: dict, chat: Any) -> None:
    body = {"max_tokens": 8, "tools": [WEATHER], "tool_choice": choice,
            "messages": [{"role": "user", "content": "hi"}]}
    got = chat_of(body)["tool_choice"]
    assert (got if isinstance(got, str) else
            {"type": got["type"], "function": {"name": got["function"]["name"]}}) == chat


def test_an_errored_tool_result_says_so_and_parallel_calls_can_be_turned_off() -> None:
    body = {"max_tokens": 8, "tools": [WEATHER],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": "no such city",
                 "is_error": True}]}]}
    chat = chat_of(body)
    assert chat["messages"] == [{"role": "tool", "tool_call_id": "t",
                                 "content": "Error: no such city"}]
    assert chat["parallel_tool_calls"] is False


@pytest.mark.parametrize("body, param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": ""}}]}]},
     "messages.0.content.0.type"),
])
def test_what_is_not_served_here_is_a_400_naming_it(body: dict, param: str) -> None:
    full = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(APIError) as exc:
        ROUTES["messages"].parse(full)  # type: ignore[misc]
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message
    assert param in exc.value.message


def test_a_body_anthropic_would_refuse_is_refused_and_max_tokens_is_required() -> None:
    for body in ({"messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
                 {"max_tokens": 8, "tool_choice": {"type": "tool"}, "tools": [WEATHER],
                  "messages": [{"role": "user", "content": "hi"}]},  # which tool?
                 {"max_tokens": 8, "messages": [{"role": "user", "content": [  # a user's call
                     {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
                 {"max_tokens": 8, "messages": [{"role": "user", "content": ""}]},
                 {"max_tokens": 8, "messages": []},
                 {"max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]}):
        with pytest.raises(APIError) as exc:
            ROUTES["messages"].parse(body)  # type: ignore[misc]
        assert anthropic.error_status(exc.value.status) == 400
    assert anthropic.error_body(429, "slow down") == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    assert anthropic.error_body(503, "x")["error"]["type"] == "overloaded_error"


def reply(body: dict[str, Any], answer: str, info: m.TokenizerInfo, tok: GatewayTokenizer,
          finish: str = "stop") -> tuple[MessagesFormatter, list[Any]]:
    """The Messages formatter of a request the fake engine answers with `answer`."""
    return answered("messages", body, info, tok, answer, finish)


def test_a_reply_and_its_stream_say_the_same_in_anthropics_shapes(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    body = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
    out = whole(*reply(body, " Paris.", smollm2_info, smollm2))
    assert out == {"id": "msg_rid-1", "type": "message", "role": "assistant", "model": "tiny",
                   "content": [{"type": "text", "text": " Paris."}], "stop_reason": "end_turn",
                   "stop_sequence": None,
                   "usage": {"input_tokens": len(smollm2.encode("Hi")),
                             "output_tokens": len(smollm2.encode(" Paris."))}}
    events = streamed(*reply({**body, "stream": True}, " Paris.", smollm2_info, smollm2))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e["delta"]["text"] for e in events[2:-3]) == " Paris."
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == out["usage"]["output_tokens"]
    frame = MessagesFormatter.frame(events[0]).decode()
    assert frame.startswith("event: message_start\ndata: {") and frame.endswith("}\n\n")
    assert MessagesFormatter.closing is None  # no [DONE]: message_stop ends it


def test_a_length_cut_and_a_stop_sequence_are_named_as_anthropic_names_them(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    body = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
    cut = whole(*reply(body, " Paris is", smollm2_info, smollm2, finish="length"))
    assert cut["stop_reason"] == "max_tokens"
    stopped = whole(*reply({**body, "stop_sequences": [" is"]}, " Paris is big",
                           smollm2_info, smollm2))
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", " is")
    assert stopped["content"] == [{"type": "text", "text": " Paris"}]


def test_a_tool_call_comes_back_as_a_tool_use_block_whole_and_streamed(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    body = {"model": "tiny", "max_tokens": 64, "tools": [WEATHER], "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    out = whole(*reply(body, call, smollm2_info, smollm2))
    [block] = out["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["id"]
    assert block["input"] == {"city": "Paris"} and out["stop_reason"] == "tool_use"
    events = streamed(*reply({**body, "stream": True}, call, smollm2_info, smollm2))
    [start] = [e for e in events if e["type"] == "content_block_start"]
    assert start["content_block"]["type"] == "tool_use"
    assert start["content_block"]["name"] == "get_weather"
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


# Issue 54: values of the wrong type, read before the schema had checked them, were 500s
# (`'bool' object is not iterable` in refuse_unsupported); the schema now reads first.
MALFORMED = [{"messages": True}, {"messages": 5}, {"messages": [True, None, {"content": 3}]},
             {"messages": [{"role": "user", "content": "hi"}], "tools": True},
             {"messages": [{"role": "user", "content": "hi"}], "tools": 1e308},
             {"messages": [{"role": "user", "content": {"type": "image"}}]},
             {"messages": [{"role": "user", "content": [None, 7, {"type": None}]}]}]


@pytest.mark.parametrize("schema", [anthropic.MessagesRequest, anthropic.CountTokensRequest])
@pytest.mark.parametrize("body", MALFORMED)
def test_a_malformed_body_is_a_4xx_never_a_type_error(schema: Any, body: dict[str, Any]) -> None:
    with pytest.raises(APIError) as exc:
        anthropic.parse(schema, {"model": "m", "max_tokens": 10, **body})
    assert 400 <= exc.value.status < 500


def test_an_unsupported_block_is_still_named_when_the_schema_refuses_it() -> None:
    with pytest.raises(APIError) as exc:
        anthropic.parse(anthropic.MessagesRequest, {"max_tokens": 10, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert exc.value.status == 400 and "'image' blocks are not supported" in exc.value.message
