"""gateway/dialects/ollama*.py alone: an Ollama body into the request it asks for (golden
translations), and an answer from the fake engine next door back into Ollama's objects, whole
and as JSON lines."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.dialects.ollama_reply import OllamaFormatter
from gateway.http.errors import APIError
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import messages as m
from tests.gateway.fake_engine import ROUTES, answered, streamed, whole

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_a_chat_with_options_format_and_a_tool_round_becomes_the_chat_request() -> None:
    body = {"model": "m", "tools": TOOLS,
            "options": {"temperature": 0.2, "top_p": 0.9, "top_k": 7, "num_predict": 50,
                        "stop": ["\n\n"], "seed": 3, "num_ctx": 4096},  # num_ctx: ours
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_name": "get_weather", "content": "22 C"}]}
    chat = ROUTES["ollama_chat"].parse(body)  # type: ignore[misc]
    assert isinstance(chat, ChatCompletionRequest)
    got = chat.model_dump(exclude_unset=True)
    assert got["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "22 C", "tool_call_id": "call_0"}]
    assert (got["temperature"], got["top_p"], got["top_k"], got["max_tokens"], got["stop"],
            got["seed"]) == (0.2, 0.9, 7, 50, ["\n\n"], 3)
    assert got["stream"] is True  # Ollama streams unless told not to
    assert got["tools"][0]["function"]["name"] == "get_weather"
    shaped = ROUTES["ollama_chat"].parse(  # type: ignore[misc]
        {"messages": [{"role": "user", "content": "x"}], "format": {"type": "object"}})
    assert shaped.response_format is not None and shaped.response_format.type == "json_schema"


def test_generate_is_a_templated_turn_and_raw_is_the_prompt_as_it_is() -> None:
    templated = ROUTES["ollama_generate"].parse(  # type: ignore[misc]
        {"model": "m", "prompt": "2+2?", "system": "Be brief.", "stream": False,
         "format": "json", "options": {"num_predict": -1}})
    assert isinstance(templated, ChatCompletionRequest)
    assert [(x.role, x.content) for x in templated.messages] == [
        ("system", "Be brief."), ("user", "2+2?")]
    assert templated.max_tokens is None and templated.stream is False  # -1: to the end
    assert templated.response_format is not None
    assert templated.response_format.type == "json_object"
    raw = ROUTES["ollama_generate"].parse({"prompt": "2+2=", "raw": True})  # type: ignore[misc]
    assert isinstance(raw, CompletionRequest) and raw.prompt == "2+2="


@pytest.mark.parametrize("body", [
    {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "user", "content": "x"}], "options": {"temperature": -1}},
    {"messages": [{"role": "user", "content": "x"}], "format": "yaml"},
    {"messages": [{"role": "user", "content": "x"}], "format": "json", "tools": TOOLS},
    {"messages": [{"role": "assistant"}]},  # says nothing
])
def test_a_bad_chat_body_is_refused_with_a_422(body: dict[str, Any]) -> None:
    with pytest.raises(APIError) as exc:
        ROUTES["ollama_chat"].parse(body)  # type: ignore[misc]
    assert exc.value.status == 422 and exc.value.message


def reply(route: str, body: dict[str, Any], answer: str, info: m.TokenizerInfo,
          tok: GatewayTokenizer, finish: str = "stop") -> tuple[Any, list[Any]]:
    return answered(route, body, info, tok, answer, finish, max_tokens=64)


def lines(fmt: Any, events: list[Any]) -> list[dict[str, Any]]:
    return streamed(fmt, events)


def test_a_chat_answer_and_its_lines_say_the_same(smollm2_info: m.TokenizerInfo,
                                                  smollm2: GatewayTokenizer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    out = whole(*reply("ollama_chat", {**body, "stream": False}, " Paris.", smollm2_info,
                       smollm2))
    assert out["message"] == {"role": "assistant", "content": " Paris."}
    assert out["done"] is True and out["done_reason"] == "stop" and out["model"] == "tiny"
    assert out["eval_count"] == len(smollm2.encode(" Paris."))
    assert out["prompt_eval_count"] == len(smollm2.encode("Hi"))
    assert out["total_duration"] >= out["eval_duration"] >= 0 and out["created_at"].endswith("Z")
    got = lines(*reply("ollama_chat", body, " Paris.", smollm2_info, smollm2))
    assert all(not x["done"] for x in got[:-1]) and got[-1]["done"] is True
    assert "".join(x["message"]["content"] for x in got) == " Paris."
    assert got[-1]["eval_count"] == out["eval_count"]
    raw = OllamaFormatter.frame(got[0])
    assert raw.endswith(b"\n") and b"\n" not in raw[:-1] and json.loads(raw) == got[0]
    assert OllamaFormatter.closing is None and OllamaFormatter.keepalive is None


def test_generate_answers_in_response_and_a_length_cut_says_length(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    out = whole(*reply("ollama_generate", {"model": "tiny", "prompt": "Hi", "stream": False},
                       " Paris is", smollm2_info, smollm2, finish="length"))
    assert out["response"] == " Paris is" and out["done_reason"] == "length"
    assert "message" not in out


def test_a_tool_call_comes_back_whole_with_its_arguments_as_an_object(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    body = {"model": "tiny", "tools": TOOLS,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    out = whole(*reply("ollama_chat", {**body, "stream": False}, call, smollm2_info, smollm2))
    assert out["message"]["tool_calls"] == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    got = lines(*reply("ollama_chat", body, call, smollm2_info, smollm2))
    [with_call] = [x for x in got if x["message"].get("tool_calls")]
    assert with_call["message"]["tool_calls"] == out["message"]["tool_calls"]
    assert got[-1]["done"] is True
