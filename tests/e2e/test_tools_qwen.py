"""Tool calls from a real Qwen2.5 model behind the real gateway and worker, through the official
openai client, nothing mocked: Qwen2.5-Coder-0.5B-Instruct (GGUF, Q4_K_M) gets the tools from its
own chat template, and asked for the weather it calls get_weather, answered as tool_calls with
finish_reason "tool_calls", streamed and not; the tool's result then goes back through the
template as a `tool` turn.

Skipped when the file is not in the cache's gguf/ folder (tests/conftest.py's qwen_server).
A request takes a few seconds.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import QWEN_MODEL as MODEL
from tests.procs import GatewayProc

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(qwen_server: GatewayProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen_server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_asked_for_the_weather_it_calls_get_weather(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                         temperature=0, max_tokens=60)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()


def test_required_streamed_sends_the_call_as_deltas_and_never_the_tags(
        client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=60, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "tool_call" not in content
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert {t.index for t in calls} == {0} and calls[0].function.name == "get_weather"
    args = json.loads("".join(t.function.arguments or "" for t in calls))
    assert "paris" in args["city"].lower()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_the_tools_result_goes_back_through_the_template(client: openai.OpenAI) -> None:
    history = [*QUESTION,
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1",
                "content": '{"temperature_c": 22, "sky": "sunny"}'}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         tool_choice="none", temperature=0, max_tokens=40)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert not choice.message.tool_calls
