"""Structured output and tool calls on the real SmolLM2 behind the real gateway and worker, through
the official openai client and LangChain: parsed pydantic objects, calls whose arguments validate
against the tool's schema, and a conversation that continues after a tool result."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.smollm
MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]


PROMPTS = [f"Describe {c} as JSON." for c in (
    "Paris", "Tokyo", "Cairo", "Lima", "Sydney", "Rome", "Berlin", "Madrid", "Lagos", "Delhi",
    "Toronto", "Seoul", "Nairobi", "Oslo", "Quito", "Hanoi", "Dublin", "Vienna", "Athens",
    "Havana")]

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
                                      "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description":
                                      "Current time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTIONS = ["What is the weather in Paris?", "Is it cold in Oslo today?",
             "What time is it in Tokyo?", "Tell me the temperature in Lima in fahrenheit."]


@pytest.fixture(scope="module")
def client(smollm_server) -> openai.OpenAI:  # noqa: ANN001
    gw, _ = smollm_server
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)


def test_parse_returns_a_pydantic_object_for_20_prompts_streamed_and_not(
        client: openai.OpenAI) -> None:
    def plain(prompt: str) -> City:
        out = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=City,
            temperature=0, max_tokens=60)
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].message.parsed

    def streamed(prompt: str) -> City:
        with client.chat.completions.stream(
                model=MODEL, messages=[{"role": "user", "content": prompt}],
                response_format=City, temperature=0, max_tokens=60) as stream:
            return stream.get_final_completion().choices[0].message.parsed

    def warm(prompt: str) -> None:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                       temperature=0, max_tokens=1)

    with ThreadPoolExecutor(4) as pool:
        # Both runs below are warm (the prompt's full blocks in the prefix cache, only the rest
        # computed): a cold run computes more rows, which may take another kernel, and its greedy
        # text can differ at a near tie (CI once saw Havana 'Argentina' cold, 'Spain' warm);
        # warm runs give the same numbers whatever runs beside them (test_batch_invariance.py).
        list(pool.map(warm, PROMPTS))
        parsed = list(pool.map(plain, PROMPTS))
        parsed_streamed = list(pool.map(streamed, PROMPTS))
    for obj, obj_s in zip(parsed, parsed_streamed, strict=True):
        assert isinstance(obj, City) and isinstance(obj_s, City)
        assert obj == obj_s  # greedy: the stream carries the same answer
    assert parsed[0].name == "Paris"  # the model reads the prompt, not only the schema


def _check_call(call, allowed: set[str]) -> None:  # noqa: ANN001
    assert call.type == "function" and call.id
    assert call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_required_and_named_tool_choice_always_give_a_valid_call(client: openai.OpenAI,
                                                                 choice: str) -> None:
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}
    allowed = set(SCHEMAS) if choice == "required" else {choice}

    def ask(i_q: tuple[int, str]) -> None:
        i, question = i_q
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS,
            tool_choice=tool_choice, temperature=1.0, seed=i, max_tokens=80)
        choice0 = out.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
        assert len(choice0.message.tool_calls) == 1
        _check_call(choice0.message.tool_calls[0], allowed)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, enumerate(QUESTIONS)))


def test_streamed_tool_call_arrives_as_indexed_deltas(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], tools=TOOLS,
        tool_choice="required", temperature=0, max_tokens=80, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and all(d.index == 0 for d in deltas)
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), WEATHER)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and finishes.count("tool_calls") == 1


def test_conversation_with_a_tool_result_continues(client: openai.OpenAI) -> None:
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=0, max_tokens=80)
    msg = first.choices[0].message
    _check_call(msg.tool_calls[0], set(SCHEMAS))
    messages.append(msg.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                     "content": json.dumps({"temperature": 21, "unit": "celsius",
                                            "sky": "sunny"})})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            tool_choice="none", temperature=0, max_tokens=25)
    answer = second.choices[0].message.content
    assert second.choices[0].message.tool_calls is None
    assert answer and ("sunny" in answer or "21" in answer)  # it read the tool's result


def test_auto_gives_text_or_a_valid_call(client: openai.OpenAI) -> None:
    for question in ("What time is it in Tokyo?", "Say hello."):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS,
            tool_choice="auto", temperature=0, max_tokens=30)
        choice = out.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _check_call(choice.message.tool_calls[0], set(SCHEMAS))
        else:
            assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_langchain_bind_tools_required_named_and_a_tool_result(smollm_server) -> None:  # noqa: ANN001
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    class get_weather(BaseModel):  # noqa: N801 - the tool's name is the class name
        """Current weather in a city."""

        city: str = Field(max_length=30)
        unit: Literal["celsius", "fahrenheit"]

    class get_time(BaseModel):  # noqa: N801
        """Current time in a timezone."""

        timezone: str = Field(max_length=30)

    gw, _ = smollm_server
    llm = ChatOpenAI(model=MODEL, base_url=gw.base_url + "/v1", api_key="unused",
                     temperature=0, max_tokens=80, max_retries=0)
    schemas = {"get_weather": get_weather.model_json_schema(),
               "get_time": get_time.model_json_schema()}
    for tool_choice, allowed in (("required", set(schemas)), ("get_time", {"get_time"})):
        bound = llm.bind_tools([get_weather, get_time], tool_choice=tool_choice)
        for question in QUESTIONS[:2]:
            reply = bound.invoke([HumanMessage(question)])
            assert len(reply.tool_calls) == 1
            call = reply.tool_calls[0]
            assert call["name"] in allowed
            jsonschema.validate(call["args"], schemas[call["name"]])
    bound = llm.bind_tools([get_weather, get_time], tool_choice="required")
    history = [HumanMessage("What is the weather in Rome?")]
    reply = bound.invoke(history)
    history += [reply, ToolMessage('{"temperature": 30, "sky": "clear"}',
                                   tool_call_id=reply.tool_calls[0]["id"])]
    final = llm.bind_tools([get_weather, get_time]).invoke(history)
    assert isinstance(final.content, str)
    assert final.content or final.tool_calls  # it answered: text, or a further call
