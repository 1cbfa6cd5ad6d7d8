"""gateway/prompt/intake.py alone: a body becomes an engine request (limits, model, grammar, tokens,
sampling parameters, deadline), against the real EngineClient's registry with one fake worker."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from gateway.config import GatewayConfig
from gateway.engine.engine_client import EngineClient
from gateway.http.errors import APIError
from gateway.prompt.intake import Draft, EngineRequest, Intake
from gateway.prompt.tenancy import cache_salt
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import messages as m
from tests.gateway.fake_engine import ROUTES, FakeEngine

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def http_request(data: Any) -> Request:
    raw = json.dumps(data).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/v1/x",
                    "headers": [(b"content-length", str(len(raw)).encode())]}, receive)


@pytest.fixture
def intake(smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> Any:
    client = EngineClient("inproc://unused")
    FakeEngine(client, smollm2_info, smollm2, max_model_len=200)
    yield Intake(GatewayConfig(max_prompt_chars=300, max_tokens_cap=100, default_timeout_s=20),
                 client)
    client.link.close()


def read(intake: Intake, route: str, data: Any, arrival: float = 100.0) -> Draft:
    return asyncio.run(intake.read(ROUTES[route], http_request(data), arrival))


def prepare(intake: Intake, route: str, data: Any, key: str | None = None) -> EngineRequest:
    async def go() -> EngineRequest:
        draft = await intake.read(ROUTES[route], http_request(data), time.monotonic())
        return await intake.prepare(draft, key)

    return asyncio.run(go())


def refused(intake: Intake, route: str, data: Any) -> APIError:
    with pytest.raises(APIError) as exc:
        prepare(intake, route, data)
    return exc.value


def test_read_decides_the_deadline_and_streaming_once(intake: Intake) -> None:
    draft = read(intake, "chat", {"messages": CHAT, "stream": True, "timeout": 5})
    assert draft.deadline == 105.0 and draft.stream and draft.route.name == "chat"
    # Honoured in full, longer than the operator's default for requests that name none.
    assert read(intake, "chat", {"messages": CHAT, "timeout": 99}).deadline == 199.0
    assert read(intake, "chat", {"messages": CHAT}).deadline == 120.0
    assert not read(intake, "completions", {"prompt": "x"}).stream
    assert read(intake, "generate_stream", {"prompt": "x", "stream": False}).stream
    assert not read(intake, "generate", {"prompt": "x"}).stream


@pytest.mark.parametrize("data, status", [([1, 2], 422), ({"messages": []}, 422),
                                          ({"messages": CHAT, "n": "2"}, 422)])
def test_read_refuses_what_is_no_valid_body(intake: Intake, data: Any, status: int) -> None:
    with pytest.raises(APIError) as exc:
        read(intake, "chat", data)
    assert exc.value.status == status


def test_a_chat_request_is_its_template_tokens_and_the_routes_default(
        intake: Intake, smollm2: GatewayTokenizer) -> None:
    req = prepare(intake, "chat", {"messages": CHAT, "stop": "Paris", "seed": 3})
    expected = smollm2.encode(smollm2.apply_chat_template(CHAT), add_special_tokens=False)
    assert req.prompt_ids == expected and req.model.model_id == "tiny"
    # 512 for chat, cut to the cap (100) and the context (200 less the prompt)
    assert req.params.max_tokens == min(100, 200 - len(expected))
    assert req.stop == ["Paris"] and req.params.seed == 3 and req.params.n == 1
    assert req.params.logprobs is None and req.grammar is None and req.tool_plan is None
    assert req.cache_salt == ""
    both = prepare(intake, "chat", {"messages": CHAT, "max_tokens": 9,
                                    "max_completion_tokens": 7})
    assert both.params.max_tokens == 7  # max_completion_tokens wins
    top = prepare(intake, "chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 3})
    assert top.params.logprobs == 3


def test_completion_and_native_prompts(intake: Intake, smollm2: GatewayTokenizer) -> None:
    req = prepare(intake, "completions", {"prompt": ["Paris"], "logprobs": 2, "top_k": -1,
                                          "presence_penalty": 0.5})
    assert req.body.prompt == "Paris"  # a one-prompt batch is unwrapped for the formatter
    assert req.prompt_ids == smollm2.encode("Paris") and req.params.max_tokens == 16
    assert req.params.logprobs == 2 and req.params.top_k == 0
    assert req.params.presence_penalty == 0.5
    ids = prepare(intake, "completions", {"prompt": [5, 6, 7], "max_tokens": 4})
    assert ids.prompt_ids == [5, 6, 7] and ids.params.max_tokens == 4
    native = prepare(intake, "generate", {"prompt": "Paris", "max_new_tokens": 5,
                                          "temperature": 0.0, "n": 4})
    assert native.params.max_tokens == 5 and native.params.temperature == 0.0
    assert native.params.n == 1 and not native.stream  # the native API has no n: ignored


def test_the_cache_salt_is_the_keys_tenant(intake: Intake) -> None:
    assert prepare(intake, "generate", {"prompt": "x"}, key="k1").cache_salt == cache_salt(
        "k1", None)
    salted = prepare(intake, "generate", {"prompt": "x", "cache_salt": "s"})
    assert salted.cache_salt == cache_salt(None, "s") != ""


@pytest.mark.parametrize("route, data, status, code", [
    ("completions", {"prompt": ["a", "b"]}, 422, "invalid_value"),
    ("completions", {"prompt": "a", "logit_bias": {"1000000": 2.0}}, 400, "invalid_token_ids"),
    ("completions", {"prompt": "a", "stop_token_ids": [1000000]}, 400, "invalid_token_ids"),
    ("completions", {"prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400, "invalid_value"),
    ("completions", {"prompt": "a", "logit_bias": {"1": 101.0}}, 422, "invalid_value"),
    ("completions", {"prompt": "a", "logit_bias": {"one": 1.0}}, 422, "invalid_value"),
    ("completions", {"prompt": "a", "min_p": 1.5}, 422, "invalid_value"),
    ("completions", {"prompt": "a", "repetition_penalty": 0}, 422, "invalid_value"),
    ("completions", {"prompt": "a", "repetition_penalty": 1e-300}, 422, "invalid_value"),
    ("completions", {"prompt": "a", "logit_bias": {"01": 1.0}}, 422, "invalid_value"),
    ("completions", {"prompt": "x" * 301}, 422, "invalid_value"),
    ("completions", {"prompt": "a", "max_tokens": 101}, 422, "invalid_value"),
    ("completions", {"prompt": [1, 10**9]}, 400, "invalid_token_ids"),
    ("completions", {"prompt": "a", "model": "nope"}, 404, "model_not_found"),
    ("completions", {"prompt": "a " * 120, "max_tokens": 100}, 400, "context_length_exceeded"),
    ("chat", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "nonsense"}}}}, 400, "invalid_response_format"),
    ("chat", {"messages": CHAT, "tool_choice": "required"}, 400, "invalid_value"),
])
def test_refusals(intake: Intake, route: str, data: Any, status: int, code: str) -> None:
    err = refused(intake, route, data)
    assert (err.status, err.code) == (status, code), err.message


def test_a_structured_request_carries_its_grammar(intake: Intake) -> None:
    req = prepare(intake, "chat", {"messages": CHAT, "response_format": {"type": "json_object"}})
    assert req.grammar is not None and "json" in req.grammar.lower()


def test_no_model_yet_is_a_503(smollm2_info: m.TokenizerInfo) -> None:
    client = EngineClient("inproc://unused")
    with pytest.raises(APIError) as exc:
        Intake(GatewayConfig(), client).model(None)
    assert exc.value.status == 503 and exc.value.code == "no_worker"
    client.link.close()


QWEN = (Path(__file__).parents[2] / "data" / "qwen2.5_chat_template.jinja").read_text("utf-8")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture
def qwen_intake(smollm2_info: m.TokenizerInfo) -> Any:
    """A model whose chat template is Qwen2.5's (its tools branch), on SmolLM2's vocabulary."""
    info = dataclasses.replace(smollm2_info, chat_template=QWEN)
    client = EngineClient("inproc://unused")
    FakeEngine(client, info, GatewayTokenizer(info), max_model_len=2048)
    yield Intake(GatewayConfig(max_prompt_chars=5000, max_tokens_cap=100, default_timeout_s=20),
                 client)
    client.link.close()


def prompt_text(req: EngineRequest) -> str:
    return req.model.tokenizer.decode(req.prompt_ids, skip_special_tokens=False)


def test_tools_go_to_a_template_that_renders_them_not_into_the_generic_prompt(
        qwen_intake: Intake) -> None:
    data = {"messages": CHAT, "tools": TOOLS}
    req = prepare(qwen_intake, "chat", data)
    text = prompt_text(req)
    assert "# Tools\n\nYou may call one or more functions" in text  # Qwen2.5's own words
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", ' in text
    assert "one JSON object per line" not in text  # gateway.prompt.tools' generic prompt
    assert req.tool_plan is not None and req.tool_plan.native and req.grammar is not None
    no_tools = prompt_text(prepare(qwen_intake, "chat", {**data, "tool_choice": "none"}))
    assert "<tools>" not in no_tools and "# Tools" not in no_tools


def test_a_tool_conversation_renders_through_the_models_template(qwen_intake: Intake) -> None:
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = prompt_text(prepare(qwen_intake, "chat", {"messages": history, "tools": TOOLS}))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in text  # a mapping, not a string
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
