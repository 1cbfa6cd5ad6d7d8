"""Ollama's API end to end, through the official ollama client, nothing mocked: the real gateway
and SmolLM2 worker (the session's), and for a tool call's round trip the real
Qwen2.5-Coder-0.5B (skipped when its GGUF is not in the cache, as tests/conftest.py says)."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from tests.conftest import QWEN_MODEL
from tests.procs import GatewayProc, WorkerProc, read_then_leave, wait_outstanding_zero

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0, "num_predict": 40}
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def client(smollm_server: tuple[GatewayProc, WorkerProc]) -> ollama.Client:
    gw, _ = smollm_server
    return ollama.Client(host=gw.base_url, timeout=120)


def test_list_show_ps_and_version_name_the_served_model(
        client: ollama.Client, smollm_server: tuple[GatewayProc, WorkerProc]) -> None:
    assert [x.model for x in client.list().models] == [MODEL]
    assert [x.model for x in client.ps().models] == [MODEL]
    shown = client.show(MODEL)
    assert "completion" in (shown.capabilities or [])
    assert shown.modelinfo and shown.modelinfo["general.context_length"] > 0
    gw, _ = smollm_server
    assert httpx.get(gw.base_url + "/api/version").json()["version"]


def test_what_is_two_and_two_is_four_chat_and_generate_streamed_and_not(
        client: ollama.Client) -> None:
    out = client.chat(model=MODEL, messages=QUESTION, options=GREEDY)
    assert out.done and out.done_reason in ("stop", "length") and "4" in out.message.content
    assert out.eval_count and out.prompt_eval_count
    parts = list(client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == out.message.content
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    gen = client.generate(model=MODEL, prompt="What is 2+2?", options=GREEDY)
    assert gen.response == out.message.content  # the same templated turn
    streamed = list(client.generate(model=MODEL, prompt="What is 2+2?", options=GREEDY,
                                    stream=True))
    assert "".join(p.response for p in streamed) == gen.response
    assert streamed[-1].eval_count == gen.eval_count


def test_format_json_gives_json(client: ollama.Client) -> None:
    out = client.chat(model=MODEL, format="json", options={"temperature": 0, "num_predict": 64},
                      messages=[{"role": "user", "content": "A JSON object with a name."}])
    if out.done_reason == "stop":
        assert isinstance(json.loads(out.message.content), dict)
    else:  # cut by num_predict: still JSON so far, an object opened
        assert out.message.content.lstrip().startswith("{")


def test_errors_come_in_ollamas_shape(client: ollama.Client,
                                      smollm_server: tuple[GatewayProc, WorkerProc]) -> None:
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="nobody", messages=QUESTION)
    assert exc.value.status_code == 404 and "nobody" in exc.value.error
    gw, _ = smollm_server
    r = httpx.post(gw.base_url + "/api/chat", json={"model": MODEL, "messages": []})
    assert r.status_code == 422 and isinstance(r.json()["error"], str)
    r = httpx.post(gw.base_url + "/api/show", json={"model": "nobody"})
    assert r.status_code == 404 and r.json() == {"error": "model 'nobody' not found"}


def test_a_stream_cut_by_its_client_frees_its_place(
        smollm_server: tuple[GatewayProc, WorkerProc]) -> None:
    gw, _ = smollm_server
    got = read_then_leave(gw, "/api/chat", {
        "model": MODEL, "options": {"num_predict": 1000},
        "messages": [{"role": "user", "content": "Write a long story."}]},
        lambda got: got.count(b'"done":false') >= 2)
    assert b"application/x-ndjson" in got
    assert wait_outstanding_zero(gw) == 0
    assert 'finish_reason="aborted",route="ollama_chat",status="200"' in gw.metrics()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"}}, "required": ["city"]}}}]


def test_a_tool_call_and_its_result_round_trip_on_qwen(qwen_server: GatewayProc) -> None:
    qwen = ollama.Client(host=qwen_server.base_url, timeout=120)
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    out = qwen.chat(model=QWEN_MODEL, messages=question, tools=TOOLS,
                    options={"temperature": 0, "num_predict": 60})
    [call] = out.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert "paris" in call.function.arguments["city"].lower()
    streamed = [p for p in qwen.chat(model=QWEN_MODEL, messages=question, tools=TOOLS,
                                     options={"temperature": 0, "num_predict": 60}, stream=True)
                if p.message.tool_calls]
    assert streamed and streamed[0].message.tool_calls[0].function.arguments == \
        call.function.arguments
    answer = qwen.chat(model=QWEN_MODEL, tools=TOOLS,
                       options={"temperature": 0, "num_predict": 60},
                       messages=[*question, {"role": "assistant", "content": "",
                                             "tool_calls": [call]},
                                 {"role": "tool", "tool_name": "get_weather",
                                  "content": '{"temperature_c": 22, "sky": "sunny"}'}])
    assert "22" in answer.message.content, answer.message
