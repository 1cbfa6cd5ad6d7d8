"""gateway/http/schemas.py: OpenAI's types, strictly; the bounds; the configured limits; and how a
violation is named in the 422 (gateway/errors.validation_error). Also how parsed values become
the limits a request runs under (Intake.sampling and Intake.deadline)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from gateway.config import GatewayConfig
from gateway.http.errors import APIError, validation_error
from gateway.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    RequestBase,
    RequestLimitError,
    check_limits,
)
from gateway.service import GatewayState

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def rejected(cls: type[BaseModel], body: dict[str, Any]) -> APIError:
    with pytest.raises(ValidationError) as exc:
        cls.model_validate(body)
    err = validation_error(exc.value)
    assert err.status == 422 and err.code == "invalid_value"
    return err


def test_minimal_bodies_and_their_defaults() -> None:
    c = CompletionRequest.model_validate({"prompt": "hi"})
    assert (c.max_tokens, c.temperature, c.top_p, c.n, c.stream) == (None, 1.0, 1.0, 1, False)
    chat = ChatCompletionRequest.model_validate(CHAT)
    assert chat.requested_max_tokens() is None
    assert GenerateRequest.model_validate({"prompt": "hi"}).max_new_tokens is None


def test_unknown_fields_are_ignored() -> None:
    c = CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {"1": 2}, "zzz": [1]})
    assert not hasattr(c, "zzz")
    # response_format and tools are known fields now (issue 15): still-unknown ones here.
    ChatCompletionRequest.model_validate({**CHAT, "audio": {}, "modalities": ["text"]})
    GenerateRequest.model_validate({"prompt": "hi", "stream": "anything"})


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", "5"), ("max_tokens", 5.5), ("max_tokens", True), ("max_tokens", 0),
    ("temperature", "1"), ("temperature", True), ("temperature", 2.01), ("temperature", -0.1),
    ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0), ("top_p", 1.01), ("top_p", float("nan")),
    ("n", 0), ("n", 9), ("stream", "true"), ("stream", 1), ("echo", 0),
    ("logprobs", 6), ("logprobs", -1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.5), ("top_k", -2), ("top_k", 2**31),
    ("timeout", 0), ("timeout", -1), ("timeout", float("nan")), ("timeout", "5"),
    ("model", 3), ("user", 3), ("stream_options", {"include_usage": "yes"}),
    ("stop", ""), ("stop", ["a", ""]), ("stop", ["a"] * 5), ("stop", [1]), ("stop", 1),
])
def test_out_of_range_and_wrongly_typed_fields_are_named(field: str, value: Any) -> None:
    err = rejected(CompletionRequest, {"prompt": "hi", field: value})
    assert err.param is not None and err.param.split(".")[0] == field
    assert err.message.startswith(err.param + ": ")


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 0), ("temperature", 2), ("temperature", 1), ("top_p", 1), ("top_p", 1e-9),
    ("n", 8), ("logprobs", 0), ("logprobs", 5), ("seed", -(2**63)), ("seed", 2**64 - 1),
    ("top_k", -1), ("top_k", 0), ("timeout", 1e-3), ("stop", ["a", "b", "c", "d"]),
    ("stop", None), ("max_tokens", None), ("presence_penalty", -2), ("user", None),
    # A whole number spelled as a float is the integer JSON Schema's "integer" admits (issue 23):
    # /openapi.json cannot say otherwise, so the route takes it.
    ("max_tokens", 5.0), ("n", 2.0), ("seed", -3.0), ("top_k", 0.0), ("logprobs", 5.0),
])
def test_values_at_the_edges_are_accepted(field: str, value: Any) -> None:
    CompletionRequest.model_validate({"prompt": "hi", field: value})


@pytest.mark.parametrize(("body", "param", "says"), [
    ({}, "prompt", "required"),
    ({"prompt": 5}, "prompt", "accepted types"),
    ({"prompt": [[1]]}, "prompt", "accepted types"),
    ({"prompt": [2**40]}, "prompt.0", "less than"),
    ({"prompt": [-1]}, "prompt.0", "greater than"),
    ({"prompt": ["a", 1]}, "prompt", "accepted types"),  # neither a list of texts nor of ids
])
def test_a_prompt_is_text_texts_or_token_ids(body: dict, param: str, says: str) -> None:
    err = rejected(CompletionRequest, body)
    assert err.param == param and says in err.message


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ("hi", "messages"),
    ([{"content": "hi"}], "messages.0.role"),
    ([{"role": "robot", "content": "hi"}], "messages.0.role"),
    ([{"role": "user", "content": 5}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages.0.content.0.text"),
    ([{"role": "user", "content": [{"type": "image_url", "text": "x"}]}],
     "messages.0.content.0.type"),
])
def test_chat_messages(messages: Any, param: str) -> None:
    assert rejected(ChatCompletionRequest, {"messages": messages}).param == param


def test_chat_content_may_be_text_parts_and_max_completion_tokens_wins() -> None:
    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "system", "content": None},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_tokens": 5, "max_completion_tokens": 7})
    assert chat.messages[1].text() == "ab" and chat.messages[0].text() == ""
    assert chat.requested_max_tokens() == 7


def test_the_native_request_is_as_strict() -> None:
    assert rejected(GenerateRequest, {"prompt": [1, 2]}).param == "prompt"
    assert rejected(GenerateRequest, {"prompt": "hi", "max_new_tokens": 0}).param == \
        "max_new_tokens"
    assert rejected(GenerateRequest, {"prompt": "hi", "stop": ""}).param == "stop"
    assert rejected(GenerateRequest, {"prompt": "hi", "seed": 2**70}).param == "seed"


def test_one_base_carries_the_shared_sampling_fields_for_every_route() -> None:
    shared = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11, "ignore_eos": True,
              "speculative": False}
    bodies = [CompletionRequest.model_validate({"prompt": "x", "max_tokens": 3, **shared}),
              ChatCompletionRequest.model_validate({**CHAT, "max_completion_tokens": 3,
                                                    **shared}),
              GenerateRequest.model_validate({"prompt": "x", "max_new_tokens": 3, **shared})]
    for body in bodies:
        assert isinstance(body, RequestBase)
        assert {k: body.sampling()[k] for k in shared} == shared
        assert body.requested_max_tokens() == 3  # three spellings, one answer
        assert body.sampling()["n"] == 1
    assert not bodies[2].include_usage  # the native API has no stream_options
    assert bodies[0].sampling()["logprobs"] is None and bodies[1].sampling()["logprobs"] is None
    assert ChatCompletionRequest.model_validate(
        {**CHAT, "logprobs": True}).sampling()["logprobs"] == 0
    for cls in (CompletionRequest, ChatCompletionRequest, GenerateRequest):
        own = set(vars(cls).get("__annotations__", {}))
        assert not own & {*shared, "model", "stop", "timeout"}  # declared once, on the base


# ---- the configured limits ----------------------------------------------------------------

def test_check_limits() -> None:
    check_limits(5, None, max_prompt_chars=5, max_tokens_cap=4)
    check_limits(1, 4, max_prompt_chars=5, max_tokens_cap=4)
    for chars, max_tokens, param in [(0, 1, "prompt"), (6, 1, "prompt"), (1, 5, "max_tokens")]:
        with pytest.raises(RequestLimitError) as exc:
            check_limits(chars, max_tokens, max_prompt_chars=5, max_tokens_cap=4)
        assert exc.value.param == param


class _Hello:
    max_model_len = 100


class _Model:
    model_id = "m"
    hello = _Hello()


@pytest.fixture
def gw_state() -> GatewayState:
    return GatewayState(GatewayConfig(max_tokens_cap=30, default_timeout_s=10))


def params(state: Any, prompt_len: int, max_tokens: int | None,
           default_max: int | None = 512) -> Any:
    return state.intake.sampling(_Model(), prompt_len, max_tokens, default_max)


def test_absent_max_tokens_is_the_routes_default_within_cap_and_context(gw_state: Any) -> None:
    assert params(gw_state, 10, None).max_tokens == 30  # the cap
    assert params(gw_state, 10, None, default_max=16).max_tokens == 16  # the route's default
    assert params(gw_state, 95, None).max_tokens == 5  # what the context leaves
    assert params(gw_state, 10, 20).max_tokens == 20


def test_a_chat_without_max_tokens_runs_to_the_context_never_cut_to_an_estimate() -> None:
    """The chat route's default is the rest of the context (vLLM's), whatever the workers'
    measured speed and whatever deadline: before, it was cut to what a 30 s deadline fit."""
    state = GatewayState(GatewayConfig(max_tokens_cap=1000, default_timeout_s=1))
    from tests.gateway.fake_engine import ROUTES

    assert ROUTES["chat"].default_max_tokens is None
    assert params(state, 10, None, default_max=None).max_tokens == 90  # the context's room
    assert params(state, 10, None, default_max=16).max_tokens == 16  # completions: OpenAI's


@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(100, None), (90, 11), (1, 100)])
def test_beyond_the_context_is_a_400(gw_state: Any, prompt_len: int,
                                     max_tokens: int | None) -> None:
    with pytest.raises(APIError) as exc:
        params(gw_state, prompt_len, max_tokens)
    assert exc.value.status == 400 and exc.value.code == "context_length_exceeded"


def test_a_client_timeout_is_honoured_in_full_up_to_the_operators_maximum() -> None:
    """Before, a request's timeout was capped at the 30 s default: a 600 s timeout was 30 s."""
    default = GatewayState(GatewayConfig()).intake
    assert default.deadline(50.0, None) is None  # no timeout asked, none set: no deadline
    assert default.deadline(50.0, 600.0) == 650.0  # in full
    bounded = GatewayState(GatewayConfig(default_timeout_s=10, max_timeout_s=100)).intake
    assert bounded.deadline(50.0, None) == 60.0  # the operator's default
    assert bounded.deadline(50.0, 99.0) == 149.0  # longer than the default: honoured
    assert bounded.deadline(50.0, 1e9) == 150.0  # held to the maximum
    assert bounded.deadline(50.0, float("inf")) == 150.0
    with pytest.raises(ValueError):
        GatewayConfig(default_timeout_s=200, max_timeout_s=100)
