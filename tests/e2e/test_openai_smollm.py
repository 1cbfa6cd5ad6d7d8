"""The real SmolLM2 behind the real gateway and worker, through the official openai client."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.smollm

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(smollm_server) -> openai.OpenAI:  # noqa: ANN001
    gw, _ = smollm_server
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_answers_paris_and_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=40,
                  messages=[{"role": "user", "content": QUESTION}])
    full = client.chat.completions.create(**kwargs)
    text = full.choices[0].message.content
    assert "Paris" in text
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].usage is not None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens


def test_completion_answers_paris_and_stream_equals_non_stream(client: openai.OpenAI) -> None:
    prompt = ("<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n")
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt=prompt, temperature=0, max_tokens=40)
    full = client.completions.create(**kwargs)
    assert "Paris" in full.choices[0].text
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text


def test_stop_string_is_not_emitted_and_stream_agrees(client: openai.OpenAI) -> None:
    kwargs = dict(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=40, stop=["Paris"],
                  messages=[{"role": "user", "content": QUESTION}])
    full = client.chat.completions.create(**kwargs)
    text = full.choices[0].message.content
    assert "Paris" not in text and full.choices[0].finish_reason == "stop"
    assert text.startswith("The capital of France is")
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == text


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [mdl.id for mdl in client.models.list().data] == ["SmolLM2-135M-Instruct"]
