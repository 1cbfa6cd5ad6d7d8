"""The real SmolLM2 behind the real gateway and worker, through the official openai client."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.capital import CHAT, PROMPT, assert_chat_names_paris, assert_completion_names_paris

pytestmark = pytest.mark.smollm

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(smollm_server) -> openai.OpenAI:  # noqa: ANN001
    gw, _ = smollm_server
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_answers_paris_and_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = assert_chat_names_paris(client, MODEL)
    text = full.choices[0].message.content
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
    # Same server, same path, one request at a time: the stream must give the same tokens.
    chunks = list(client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=30, messages=CHAT, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].usage is not None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens


def test_completion_answers_paris_and_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = assert_completion_names_paris(client, MODEL)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                            max_tokens=30, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text


def test_stop_string_is_not_emitted_and_stream_agrees(client: openai.OpenAI) -> None:
    # The answer without a stop, then with "Paris" as the stop: the same tokens up to it.
    plain = assert_chat_names_paris(client, MODEL).choices[0].message.content
    kwargs = dict(model=MODEL, temperature=0, max_tokens=30, stop=["Paris"], messages=CHAT)
    full = client.chat.completions.create(**kwargs)
    text = full.choices[0].message.content
    assert text == plain[:plain.index("Paris")] and full.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == text


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [mdl.id for mdl in client.models.list().data] == [MODEL]
