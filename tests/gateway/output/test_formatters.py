"""gateway/output/formatters.py alone: ChoiceEvents from a real Generation (fed by the fake engine
next door) rendered in each route's shape, streamed and not; no app, no intake, no admission
queue."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gateway.output.generation import ChoiceEvent
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import messages as m
from tests.gateway.fake_engine import answered, streamed, whole

PROMPT = "What is the capital of France?"


Rendered = tuple[Any, list[ChoiceEvent]]


def run(route: str, body: dict[str, Any], answer: str, info: m.TokenizerInfo,
        tok: GatewayTokenizer, finish: str = "stop", **params: Any) -> Rendered:
    """A formatter for a request the fake engine answers with `answer`, one token a frame,
    and the ChoiceEvents its Generation produced."""
    params.setdefault("max_tokens", 256)  # room for every answer (the gateway counts them)
    return answered(route, body, info, tok, answer, finish, prompt=PROMPT, **params)


collect, stream = whole, streamed


def test_chat_response_and_its_stream_say_the_same(smollm2_info: m.TokenizerInfo,
                                                   smollm2: GatewayTokenizer) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "n": 2,
            "stream_options": {"include_usage": True}}
    fmt, events = run("chat", body, " Paris.", smollm2_info, smollm2, n=2)
    out = collect(fmt, events)
    assert out["object"] == "chat.completion" and out["id"] == "chatcmpl-rid-1"
    assert out["model"] == "tiny" and isinstance(out["created"], int)
    assert abs(out["created"] - time.time()) <= 2  # the request's arrival, in Unix seconds
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        assert choice["message"] == {"role": "assistant", "content": " Paris."}
        assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    answer_tokens = len(smollm2.encode(" Paris."))
    assert out["usage"]["completion_tokens"] == 2 * answer_tokens
    assert out["usage"]["prompt_tokens"] == len(smollm2.encode(PROMPT))
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 2 * answer_tokens
    assert set(out["timings"]) == {"ttft_ms", "tpot_ms", "tokens_per_s"}

    fmt2, events2 = run("chat", body, " Paris.", smollm2_info, smollm2, n=2)
    chunks = stream(fmt2, events2)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-rid-1"
               for c in chunks)
    first = chunks[:2]
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}] * 2
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks[2:] if c["choices"]
                  and c["choices"][0]["index"] == index]
        assert "".join(d["delta"]["content"] for d in deltas) == " Paris."
        assert [d["finish_reason"] for d in deltas][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == out["usage"]  # include_usage


def test_a_chat_tool_call_is_parsed_out_of_the_text(smollm2_info: m.TokenizerInfo,
                                                    smollm2: GatewayTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"messages": [{"role": "user", "content": PROMPT}], "tools": tools,
            "tool_choice": "required"}
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    fmt, events = run("chat", body, call, smollm2_info, smollm2)
    [choice] = collect(fmt, events)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    fmt2, events2 = run("chat", {**body, "stream": True}, call, smollm2_info, smollm2)
    chunks = stream(fmt2, events2)
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks
             if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    # OpenAI's shape: the call's id and name first, then its arguments
    assert calls[0][0]["function"]["name"] == "get_weather" and calls[0][0]["id"]
    assert "".join(c[0]["function"]["arguments"] for c in calls) == '{"city":"Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("answer, content, names", [
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
     '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Sure.", ["get_weather", "get_weather"]),
    ('<tool_call>\n{"name": get_weather}\n</tool_call>', None, None),  # malformed: text
])
def test_content_then_calls_or_a_malformed_call_streamed_and_not(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer, answer: str,
        content: str | None, names: list[str] | None) -> None:
    """Hermes blocks as Qwen2.5 writes them, one token a frame: content before the first block
    streams as content, no tag text reaches the client; a malformed block is plain content."""
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    body = {"messages": [{"role": "user", "content": PROMPT}], "tools": tools}
    [choice] = collect(*run("chat", body, answer, smollm2_info, smollm2))["choices"]
    chunks = stream(*run("chat", {**body, "stream": True}, answer, smollm2_info, smollm2))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = "".join(d.get("content") or "" for d in deltas)
    finish = chunks[-1]["choices"][0]["finish_reason"]
    if names is None:
        assert choice["message"] == {"role": "assistant", "content": answer}
        assert choice["finish_reason"] == finish == "stop" and streamed == answer
        return
    assert choice["message"]["content"] == streamed == content
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names
    assert choice["finish_reason"] == finish == "tool_calls" and "<" not in streamed
    indices = [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d]
    assert indices == [0, 0, 1, 1]


def test_completion_echo_and_logprobs(smollm2_info: m.TokenizerInfo,
                                      smollm2: GatewayTokenizer) -> None:
    body = {"prompt": PROMPT, "echo": True}
    fmt, events = run("completions", body, " Paris", smollm2_info, smollm2, finish="length")
    out = collect(fmt, events)
    assert out["object"] == "text_completion" and out["id"] == "cmpl-rid-1"
    [choice] = out["choices"]
    assert choice["text"] == PROMPT + " Paris" and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None  # not asked for
    fmt2, _ = run("completions", {"prompt": PROMPT, "logprobs": 1}, " Paris", smollm2_info,
                  smollm2)
    ids = smollm2.encode(" Paris")
    fmt2.add(ChoiceEvent(0, " Paris", ids, [[t, -0.5, [[t, -0.5]]] for t in ids], "stop"))
    logprobs = fmt2.response()["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == " Paris"
    assert logprobs["token_logprobs"] == [-0.5] * len(ids)
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(
        logprobs["text_offset"])
    chunks = stream(*run("completions", {**body, "stream": True}, " Paris", smollm2_info,
                         smollm2))
    assert chunks[0]["choices"][0]["text"] == PROMPT  # the echo goes first
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + " Paris"


def test_chat_logprobs_carry_bytes_and_alternatives(smollm2_info: m.TokenizerInfo,
                                                    smollm2: GatewayTokenizer) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True,
            "top_logprobs": 1}
    fmt, _ = run("chat", body, "é", smollm2_info, smollm2)
    ids = smollm2.encode("é")
    fmt.add(ChoiceEvent(0, "é", ids, [[t, -1.0, [[t, -1.0]]] for t in ids], "stop"))
    content = fmt.response()["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids)
    for entry in content:
        assert entry["logprob"] == -1.0 and entry["bytes"] == list(entry["token"].encode())
        assert entry["top_logprobs"][0]["token"] == entry["token"]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_native_shapes(route: str, smollm2_info: m.TokenizerInfo,
                       smollm2: GatewayTokenizer) -> None:
    fmt, events = run(route, {"prompt": PROMPT}, " Paris.", smollm2_info, smollm2)
    if route == "generate":
        out = collect(fmt, events)
        assert out["id"] == "cmpl-rid-1" and out["text"] == " Paris."
        assert out["finish_reason"] == "stop"
        assert out["completion_tokens"] == len(smollm2.encode(" Paris."))
        assert out["ttft_ms"] == out["timings"]["ttft_ms"]  # flat and nested
        return
    chunks = stream(fmt, events)
    assert "".join(c["text"] for c in chunks) == " Paris."
    assert sum("ttft_ms" in c for c in chunks[:-1]) == 1  # on the first token only...
    assert "ttft_ms" in chunks[0]
    last = chunks[-1]  # ...and with the totals on the last
    assert last["finish_reason"] == "stop" and last["completion_tokens"] == len(
        smollm2.encode(" Paris."))
    assert json.dumps(last)  # plain JSON
