"""Anthropic's Messages API end to end, through the official anthropic client, nothing mocked:
the real gateway and SmolLM2 worker (the session's), and for a tool call's round trip the real
Qwen2.5-Coder-0.5B (skipped when its GGUF is not in the cache, as tests/conftest.py says).

The client of today no longer sends sampling fields (temperature and the like): greedy decoding
is asked for through `extra_body`, which the route accepts as Anthropic's API does.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.conftest import QWEN_MODEL
from tests.procs import GatewayProc, WorkerProc, read_then_leave, wait_outstanding_zero

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def client(smollm_server: tuple[GatewayProc, WorkerProc]) -> anthropic.Anthropic:
    gw, _ = smollm_server
    return anthropic.Anthropic(base_url=gw.base_url, api_key="unused", max_retries=0,
                               timeout=120)


def test_what_is_two_and_two_is_four_whole_and_streamed(client: anthropic.Anthropic) -> None:
    out = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION,
                                 extra_body=GREEDY)
    assert out.type == "message" and out.role == "assistant" and out.model == MODEL
    [block] = out.content
    assert block.type == "text" and "4" in block.text, block.text
    assert out.stop_reason in ("end_turn", "max_tokens")
    assert out.usage.input_tokens > 0 and out.usage.output_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=40, messages=QUESTION,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text  # greedy: the stream says what the whole answer said
    assert final.stop_reason == out.stop_reason and final.usage.output_tokens == \
        out.usage.output_tokens


def test_a_system_prompt_counts_and_a_stop_sequence_ends_the_text_before_it(
        client: anthropic.Anthropic) -> None:
    plain = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION,
                                   extra_body=GREEDY)
    told = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION,
                                  system="You are a pirate.", extra_body=GREEDY)
    # the system turn is in the prompt (in place of the template's default one)
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION,
                                           system="You are a pirate.")
    assert told.usage.input_tokens == counted.input_tokens != plain.usage.input_tokens
    text = plain.content[0].text
    stop = " " + text.split()[2]  # a word the greedy answer says, with the space before it
    cut = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION,
                                 stop_sequences=[stop], extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]


def test_count_tokens_is_what_the_message_is_given_as_its_input(
        client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION, system="Be brief.")
    out = client.messages.create(model=MODEL, max_tokens=1, messages=QUESTION,
                                 system="Be brief.")
    assert counted.input_tokens == out.usage.input_tokens > 0


def test_errors_come_in_anthropics_shape(client: anthropic.Anthropic,
                                         smollm_server: tuple[GatewayProc, WorkerProc]) -> None:
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="nobody", max_tokens=4, messages=QUESTION)
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}])
    assert "image" in bad.value.message
    gw, _ = smollm_server
    r = httpx.post(gw.base_url + "/v1/messages", json={"model": MODEL, "messages": QUESTION})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = httpx.post(gw.base_url + "/v1/messages", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "Traceback" not in r.text


def test_a_stream_cut_by_its_client_frees_its_place(
        smollm_server: tuple[GatewayProc, WorkerProc]) -> None:
    gw, _ = smollm_server
    read_then_leave(gw, "/v1/messages", {
        "model": MODEL, "max_tokens": 1000, "stream": True,
        "messages": [{"role": "user", "content": "Write a long story."}]},
        lambda got: b"content_block_delta" in got)
    assert wait_outstanding_zero(gw) == 0
    metrics = gw.metrics()
    assert 'kestrel_requests_total{finish_reason="aborted",route="messages",status="200"}' \
        in metrics


def test_keys_are_taken_from_x_api_key(smollm2_dir) -> None:  # noqa: ANN001
    with GatewayProc("--api-keys", "sesame") as gw, \
            WorkerProc(smollm2_dir, gw.engine_address, "--model-id", MODEL):
        gw.wait_ready(180)
        keyed = anthropic.Anthropic(base_url=gw.base_url, api_key="sesame", max_retries=0)
        out = keyed.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
        assert out.usage.output_tokens >= 1
        wrong = anthropic.Anthropic(base_url=gw.base_url, api_key="nope", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as exc:
            wrong.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
        assert exc.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "description": "The city name"}},
               "required": ["city"]}}


def test_a_tool_call_and_its_result_round_trip_on_qwen(qwen_server: GatewayProc) -> None:
    qwen = anthropic.Anthropic(base_url=qwen_server.base_url, api_key="unused", max_retries=0,
                               timeout=120)
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    out = qwen.messages.create(model=QWEN_MODEL, max_tokens=60, messages=question,
                               tools=[WEATHER], extra_body=GREEDY)
    assert out.stop_reason == "tool_use", out.content
    [call] = [b for b in out.content if b.type == "tool_use"]
    assert call.name == "get_weather" and "paris" in call.input["city"].lower()
    with qwen.messages.stream(model=QWEN_MODEL, max_tokens=60, messages=question,
                              tools=[WEATHER], tool_choice={"type": "any"},
                              extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "get_weather" and streamed.input == call.input
    answer = qwen.messages.create(
        model=QWEN_MODEL, max_tokens=60, tools=[WEATHER], tool_choice={"type": "none"},
        extra_body=GREEDY,
        messages=[*question, {"role": "assistant", "content": out.content},
                  {"role": "user", "content": [{
                      "type": "tool_result", "tool_use_id": call.id,
                      "content": '{"temperature_c": 22, "sky": "sunny"}'}]}])
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert answer.stop_reason in ("end_turn", "max_tokens") and "22" in text, answer.content
    assert not [b for b in answer.content if b.type == "tool_use"]
