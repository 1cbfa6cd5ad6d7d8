"""gateway/dialects/responses*.py alone: a Responses body into the chat request it asks for
(golden translations, refusals), and a chat answer from the fake engine next door back into
OpenAI's response object and its stream events, checked against the openai SDK's own stream
accumulator."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.api.app import create_app
from gateway.config import GatewayConfig
from gateway.dialects.responses_reply import ResponsesFormatter
from gateway.http.errors import APIError
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import messages as m
from tests.gateway.fake_engine import ROUTES, FakeEngine, answered, streamed, whole

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": True}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}


def chat_of(body: dict[str, Any]) -> dict[str, Any]:
    return ROUTES["responses"].parse(body).model_dump(exclude_unset=True)  # type: ignore[misc]


def test_the_sdks_plain_call_is_one_user_message() -> None:
    # what client.responses.create(model=..., input="What is 2+2?") sends, and nothing else
    assert chat_of({"model": "m", "input": "What is 2+2?"}) == {
        "model": "m", "stream": False,
        "messages": [{"role": "user", "content": "What is 2+2?"}]}


def test_a_conversation_with_a_call_and_its_result_becomes_the_chat_it_asks_for() -> None:
    body = {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 64, "temperature": 0.5,
        "top_p": 0.9, "stream": True, "store": False, "parallel_tool_calls": False,
        "tools": [WEATHER], "tool_choice": "required", "metadata": {"who": "test"},
        "input": [
            {"role": "developer", "content": "Answer in English."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            # an earlier response's output items, sent back as they came
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1",
             "name": "get_weather", "arguments": '{"city":"Paris"}', "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "22 C"},
            {"role": "user", "content": "And so?"},
        ]}
    chat = chat_of(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
        {"role": "user", "content": "And so?"},
    ]
    assert chat["tools"] == [CHAT_WEATHER]
    assert (chat["tool_choice"], chat["max_tokens"], chat["parallel_tool_calls"]) == (
        "required", 64, False)
    assert (chat["temperature"], chat["top_p"], chat["stream"]) == (0.5, 0.9, True)


def test_calls_without_a_turn_before_them_make_one_assistant_turn() -> None:
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "get_weather",
              "arguments": "{}"} for i in range(2)]
    chat = chat_of({"input": [{"role": "user", "content": "hi"}, *calls,
                              {"type": "function_call_output", "call_id": "c0",
                               "output": [{"type": "input_text", "text": "sunny"}]}]})
    assert [c["id"] for c in chat["messages"][1]["tool_calls"]] == ["c0", "c1"]
    assert chat["messages"][1]["content"] is None
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "c0", "content": "sunny"}


@pytest.mark.parametrize("choice, chat", [
    ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice_maps_to_the_chat_routes_names(choice: Any, chat: Any) -> None:
    got = chat_of({"input": "hi", "tools": [WEATHER], "tool_choice": choice})["tool_choice"]
    assert (got if isinstance(got, str) else
            {"type": got["type"], "function": {"name": got["function"]["name"]}}) == chat
    if choice in ("auto", "none"):  # without tools there is nothing to choose from
        assert "tool_choice" not in chat_of({"input": "hi", "tool_choice": choice})


@pytest.mark.parametrize("fmt, chat", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "answer", "strict": True,
      "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}},
     {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
         "type": "object", "properties": {"n": {"type": "integer"}}}}}),
])
def test_text_format_becomes_the_chat_routes_response_format(fmt: dict, chat: Any) -> None:
    got = ROUTES["responses"].parse({"input": "hi", "text": {"format": fmt}})  # type: ignore[misc]
    assert (got.response_format.model_dump(by_alias=True, exclude_none=True)
            if got.response_format else None) == chat


def test_top_logprobs_or_their_include_ask_the_chat_route_for_logprobs() -> None:
    assert "logprobs" not in chat_of({"input": "hi"})
    chat = chat_of({"input": "hi", "top_logprobs": 2})
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 2)
    chat = chat_of({"input": "hi", "include": ["message.output_text.logprobs"]})
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 0)


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
    ({"tools": [WEATHER, {"type": "web_search"}]}, "tools.1.type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools.0.type"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1}]}, "tools.0.type"),
    ({"tools": [{"type": "local_shell"}]}, "tools.0.type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.output.0.type"),
])
def test_what_is_not_served_here_is_a_400_naming_it(body: dict, param: str) -> None:
    with pytest.raises(APIError) as exc:
        ROUTES["responses"].parse({"input": "hi", **body})  # type: ignore[misc]
    assert (exc.value.status, exc.value.param, exc.value.code) == (
        400, param, "unsupported_parameter"), exc.value.message
    assert param in exc.value.message


def test_store_is_accepted_whatever_its_value() -> None:
    for store in (None, False, True):
        assert chat_of({"input": "hi", "store": store})["messages"]


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": ""}]}, "input.0.content"),
    ({"input": [{"type": None}]}, "input.0"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.json_schema.schema"),
])
def test_a_body_openai_would_refuse_is_a_422_naming_its_field(body: dict, param: str) -> None:
    with pytest.raises(APIError) as exc:
        ROUTES["responses"].parse(body)  # type: ignore[misc]
    assert (exc.value.status, exc.value.param) == (422, param), exc.value.message
    with pytest.raises(APIError) as exc:
        ROUTES["responses"].parse(["not", "an", "object"])  # type: ignore[misc]
    assert exc.value.status == 422


def test_errors_keep_openais_shape_with_the_dialects_field_names() -> None:
    status, body = ResponsesFormatter.error_shape(400, "too long", "max_tokens",
                                                  "context_length_exceeded")
    assert status == 400 and body == {"error": {
        "message": "too long", "type": "invalid_request_error", "param": "max_output_tokens",
        "code": "context_length_exceeded"}}
    assert ResponsesFormatter.error_shape(400, "x", "messages.2.content", None)[1][
        "error"]["param"] == "input"
    assert ResponsesFormatter.error_shape(400, "x", "response_format", None)[1][
        "error"]["param"] == "text.format"


def reply(body: dict[str, Any], answer: str, info: m.TokenizerInfo, tok: GatewayTokenizer,
          finish: str = "stop") -> tuple[ResponsesFormatter, list[Any]]:
    """The Responses formatter of a request the fake engine answers with `answer`."""
    return answered("responses", body, info, tok, answer, finish)


def sdk_final(events: list[dict[str, Any]], tools: list[dict] | None = None) -> Any:
    """What the openai SDK's stream accumulator (client.responses.stream) makes of the events:
    it raises on an event out of order or an item it cannot match."""
    state: ResponseStreamState = ResponseStreamState(input_tools=tools or [], text_format=omit)
    adapter: TypeAdapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        state.handle_event(adapter.validate_python(event))
    return state._completed_response


def test_a_reply_and_its_stream_say_the_same_in_openais_shapes(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 64, "temperature": 0,
            "metadata": {"who": "test"}}
    out = whole(*reply(body, " Paris.", smollm2_info, smollm2))
    usage = {"input_tokens": len(smollm2.encode("Hi")),
             "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
             "output_tokens": len(smollm2.encode(" Paris.")),
             "output_tokens_details": {"reasoning_tokens": 0}}
    usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
    assert out["output"] == [{"id": "msg_rid-1", "type": "message", "status": "completed",
                              "role": "assistant", "content": [{
                                  "type": "output_text", "text": " Paris.", "annotations": [],
                                  "logprobs": []}]}]
    assert out["usage"] == usage
    assert {k: out[k] for k in ("id", "object", "status", "incomplete_details", "model",
                                "store", "temperature", "max_output_tokens", "metadata",
                                "text", "tool_choice", "tools", "previous_response_id")} == {
        "id": "resp_rid-1", "object": "response", "status": "completed",
        "incomplete_details": None, "model": "tiny", "store": False, "temperature": 0.0,
        "max_output_tokens": 64, "metadata": {"who": "test"}, "text": {"format": {
            "type": "text"}}, "tool_choice": "auto", "tools": [], "previous_response_id": None}
    assert Response.model_validate(out).output_text == " Paris."  # the SDK's type, strictly

    events = streamed(*reply({**body, "stream": True}, " Paris.", smollm2_info, smollm2))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events[4:-4]) == " Paris."
    assert events[0]["response"]["status"] == "in_progress"
    final = events[-1]["response"]
    assert final["output"] == out["output"] and final["usage"] == out["usage"]
    assert sdk_final(events).output_text == " Paris."
    frame = ResponsesFormatter.frame(events[0]).decode()
    assert frame.startswith("event: response.created\ndata: {") and frame.endswith("}\n\n")
    assert ResponsesFormatter.closing is None  # no [DONE]: response.completed ends it


def test_a_length_cut_is_incomplete_for_max_output_tokens(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 3}
    cut = whole(*reply(body, " Paris is", smollm2_info, smollm2, finish="length"))
    assert (cut["status"], cut["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"})
    assert cut["output"][0]["status"] == "incomplete"
    events = streamed(*reply({**body, "stream": True}, " Paris is", smollm2_info, smollm2,
                             finish="length"))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"] == cut["output"]


def test_a_tool_call_comes_back_as_a_function_call_item_whole_and_streamed(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    body = {"model": "tiny", "input": "Weather in Paris?", "tools": [WEATHER],
            "tool_choice": "required"}
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    out = whole(*reply(body, call, smollm2_info, smollm2))
    [item] = out["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert item["call_id"].startswith("call_") and item["id"] == "fc_rid-1_0"
    assert json.loads(item["arguments"]) == {"city": "Paris"} and out["status"] == "completed"
    assert out["tools"] == [WEATHER] and out["tool_choice"] == "required"
    events = streamed(*reply({**body, "stream": True}, call, smollm2_info, smollm2))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    assert events[2]["item"]["type"] == "function_call" and events[2]["item"]["arguments"] == ""
    assert json.loads(events[3]["delta"]) == {"city": "Paris"}
    assert events[4]["arguments"] == events[3]["delta"]
    final = sdk_final(events, [WEATHER])
    [fc] = final.output
    assert (fc.name, fc.parsed_arguments) == ("get_weather", {"city": "Paris"})


def test_an_error_inside_a_stream_is_numbered_and_raised_by_the_sdk(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    fmt, _ = reply({"model": "tiny", "input": "Hi", "stream": True}, " Paris.", smollm2_info,
                   smollm2)
    started = fmt.stream_start()
    error = fmt.stream_error(503, "the worker was lost", "worker_lost")
    assert error["sequence_number"] == len(started)
    assert (error["type"], error["code"], error["message"]) == (
        "error", "worker_lost", "the worker was lost")
    # a stream's error object, as a chat stream's: the openai SDK raises it as an APIError
    assert error["error"]["message"] == "the worker was lost"
    assert ResponsesFormatter.error_chunk(429, "busy")["sequence_number"] == 0


class FailingEngine(FakeEngine):
    """Answers one token, then says the request failed (as a worker's error frame)."""

    async def _answer(self, gen: m.Generate) -> None:
        await self.client._dispatch(self.worker, m.StepOutputs([m.TokenOutput(
            gen.request_id, 0, [self.tokens[0]], None, prompt_tokens=len(gen.prompt_token_ids),
            completion_tokens=1, since_scheduled_s=0.001)]))
        await self.client._dispatch(self.worker, m.RequestError(gen.request_id, "it broke",
                                                                "unavailable"))


def test_through_the_app_an_answer_is_counted_as_responses_and_a_failed_stream_ends_in_error(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    app = create_app(GatewayConfig())
    engine = FakeEngine(app.state.gateway.client, smollm2_info, smollm2,
                        tokens=tuple(smollm2.encode(" Paris.")), finish_reason="stop")
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 8}

    async def post(json_body: dict[str, Any]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return await http.post("/v1/responses", json=json_body)

    out = asyncio.run(post(body))
    assert out.status_code == 200 and Response.model_validate(out.json()).output_text == " Paris."
    FailingEngine(app.state.gateway.client, smollm2_info, smollm2,
                  tokens=tuple(smollm2.encode(" Paris.")))
    streamed = asyncio.run(post({**body, "stream": True}))
    assert streamed.status_code == 200
    frames = [f for f in streamed.text.split("\n\n") if f.startswith("event: ")]
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "error" and frames[-1].startswith("event: error\n")
    assert (events[-1]["code"], events[-1]["message"]) == ("unavailable", "it broke")
    assert "response.output_text.delta" in [e["type"] for e in events]
    assert not [e for e in events if e["type"] == "response.completed"]
    [family] = app.state.gateway.metrics.requests.collect()
    routes = {(s.labels["route"], s.labels["status"]) for s in family.samples
              if s.name.endswith("_total") and s.value}
    assert routes == {("responses", "200"), ("responses", "503")}
    assert engine.sent  # the first engine answered the first request
