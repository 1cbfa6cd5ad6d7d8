"""OpenAI's Responses API end to end, through the official openai client, nothing mocked: the
real gateway and SmolLM2 worker (the session's), and for a tool call's round trip the real
Qwen2.5-Coder-0.5B (skipped when its GGUF is not in the cache, as tests/conftest.py says).
The client's own stream accumulator (`client.responses.stream`) reads the events, so an event
out of its order, or an item it cannot match, fails here."""

from __future__ import annotations

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.conftest import QWEN_MODEL
from tests.procs import GatewayProc, WorkerProc, read_then_leave, wait_outstanding_zero

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is 2+2?"


@pytest.fixture(scope="module")
def client(smollm_server: tuple[GatewayProc, WorkerProc]) -> openai.OpenAI:
    gw, _ = smollm_server
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_what_is_two_and_two_is_four_whole_and_streamed(client: openai.OpenAI) -> None:
    out = client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                  max_output_tokens=40)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.status in ("completed", "incomplete") and "4" in out.output_text, out.output_text
    assert out.store is False  # nothing is kept here
    [item] = out.output
    assert item.type == "message" and item.role == "assistant"
    usage = out.usage
    assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    # create(stream=True): the raw events, in OpenAI's order, numbered
    events = list(client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                          max_output_tokens=40, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if out.status == "completed"
                         else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == out.output_text  # greedy: the stream says what the whole answer said
    # responses.stream(): the client's own accumulator over the same events
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0,
                                 max_output_tokens=40) as stream:
        final = stream.get_final_response()
    assert final.output_text == out.output_text and final.usage is not None
    assert final.usage.output_tokens == usage.output_tokens


def test_the_sdks_plainest_call_is_answered(client: openai.OpenAI,
                                            smollm_server: tuple[GatewayProc, WorkerProc]
                                            ) -> None:
    # nothing but a model and an input, as the SDK's own first example (streamed: sampled at
    # temperature 1 with no max_output_tokens, SmolLM2 may write up to the server's cap, which
    # on a busy 2-core host takes minutes; the body is the one a whole answer is asked with)
    stream = client.responses.create(model=MODEL, input=QUESTION, stream=True)
    kinds = []
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            break
    stream.close()
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"], kinds
    gw, _ = smollm_server
    assert wait_outstanding_zero(gw) == 0


def test_instructions_count_and_a_cut_is_incomplete(client: openai.OpenAI) -> None:
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3,
                                    temperature=0)
    told = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3,
                                   temperature=0, instructions="You are a pirate.")
    assert plain.usage is not None and told.usage is not None
    assert told.usage.input_tokens != plain.usage.input_tokens
    assert told.instructions == "You are a pirate."
    assert (plain.status, plain.incomplete_details and plain.incomplete_details.reason) == (
        "incomplete", "max_output_tokens")
    assert plain.usage.output_tokens == 3


def test_top_logprobs_come_with_the_text_whole_and_streamed(client: openai.OpenAI) -> None:
    ask = {"model": MODEL, "input": QUESTION, "max_output_tokens": 5, "temperature": 0,
           "top_logprobs": 2, "include": ["message.output_text.logprobs"]}
    out = client.responses.create(**ask)  # type: ignore[call-overload]
    [part] = out.output[0].content  # type: ignore[union-attr]
    assert part.logprobs and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs or []) == 2 for lp in part.logprobs)
    with client.responses.stream(**ask) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    assert [lp.token for e in deltas for lp in e.logprobs] == [lp.token for lp in part.logprobs]


class Sum(BaseModel):
    answer: int


def test_text_format_holds_the_answer_to_a_json_schema(client: openai.OpenAI) -> None:
    out = client.responses.parse(model=MODEL, input=QUESTION, text_format=Sum, temperature=0,
                                 max_output_tokens=40)
    assert isinstance(out.output_parsed, Sum), out.output_text
    assert out.text is not None and out.text.format.type == "json_schema"


def test_refusals_are_400s_in_openais_shape(client: openai.OpenAI,
                                            smollm_server: tuple[GatewayProc, WorkerProc]
                                            ) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "web_search"}])
    assert bad.value.code == "unsupported_parameter" and "web_search" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_1")
    assert bad.value.code == "unsupported_parameter"
    assert bad.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nobody", input=QUESTION)
    gw, _ = smollm_server
    r = httpx.post(gw.base_url + "/v1/responses", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param",
                                                                "code"}
    r = httpx.post(gw.base_url + "/v1/responses", json={"model": MODEL})
    assert r.status_code == 422 and r.json()["error"]["param"] == "input"
    assert "Traceback" not in r.text


def test_a_stream_cut_by_its_client_frees_its_place(
        smollm_server: tuple[GatewayProc, WorkerProc]) -> None:
    gw, _ = smollm_server
    read_then_leave(gw, "/v1/responses", {
        "model": MODEL, "max_output_tokens": 1000, "stream": True,
        "input": "Write a long story."}, lambda got: b"response.output_text.delta" in got)
    assert wait_outstanding_zero(gw) == 0
    metrics = gw.metrics()
    assert 'kestrel_requests_total{finish_reason="aborted",route="responses",status="200"}' \
        in metrics


WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "description": "The city name"}},
               "required": ["city"], "additionalProperties": False}, "strict": True}


def test_a_tool_call_and_its_result_round_trip_on_qwen(qwen_server: GatewayProc) -> None:
    qwen = openai.OpenAI(base_url=qwen_server.base_url + "/v1", api_key="unused",
                         max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    out = qwen.responses.create(model=QWEN_MODEL, input=question, tools=[WEATHER],
                                temperature=0, max_output_tokens=60)
    [call] = [item for item in out.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id, out.output
    with qwen.responses.stream(model=QWEN_MODEL, input=question, tools=[WEATHER],
                               tool_choice="required", temperature=0,
                               max_output_tokens=60) as stream:
        final = stream.get_final_response()
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert streamed.name == "get_weather" and streamed.parsed_arguments is not None
    assert "paris" in streamed.parsed_arguments["city"].lower()  # type: ignore[index]
    # the call goes back as it came, with its result
    answer = qwen.responses.create(
        model=QWEN_MODEL, tools=[WEATHER], tool_choice="none", temperature=0,
        max_output_tokens=60,
        input=[*question, *[item.model_dump(exclude_none=True) for item in out.output],
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature_c": 22, "sky": "sunny"}'}])
    assert answer.status == "completed" and "22" in answer.output_text, answer.output
    assert not [item for item in answer.output if item.type == "function_call"]
