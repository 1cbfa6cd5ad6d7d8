"""Issue 40, end to end on the real SmolLM2 with the official openai client: logit_bias,
min_tokens, stop_token_ids, min_p and repetition_penalty change what the real worker generates
as OpenAI's and vLLM's users expect, streamed and not, with n > 1."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def client(smollm_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm_server[0].base_url + "/v1", api_key="unused",
                         max_retries=0)


def tokens(client: openai.OpenAI, text: str) -> list[int]:
    base = str(client.base_url).removesuffix("/v1/")
    out = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": text,
                                               "add_special_tokens": False}, timeout=30)
    return out.json()["tokens"]


def greedy(client: openai.OpenAI, max_tokens: int = 8, **extra: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=0, extra_body=extra or None)


def test_logit_bias_minus_100_removes_the_greedy_token_and_plus_100_forces_one(
        client: openai.OpenAI) -> None:
    plain = greedy(client, 1).choices[0].text
    [first] = tokens(client, plain)
    removed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                        logit_bias={str(first): -100})
    assert removed.choices[0].text != plain
    [forced] = tokens(client, " London")
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.7,
                                    seed=1, n=2, logit_bias={str(forced): 100})
    assert [c.text for c in out.choices] == [" London London London"] * 2


def test_min_tokens_holds_the_end_back(client: openai.OpenAI) -> None:
    short = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60,
                                           temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage is not None
    ends_at = short.usage.completion_tokens
    assert ends_at < 40
    held = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60,
                                          temperature=0, extra_body={"min_tokens": 45})
    assert held.usage is not None and held.usage.completion_tokens >= 45
    assert held.choices[0].message.content.startswith(short.choices[0].message.content.rstrip())


def test_stop_token_ids_stop_there_streamed_and_not(client: openai.OpenAI) -> None:
    text = greedy(client, 8).choices[0].text
    ids = tokens(client, text)
    stop = ids[2]
    assert stop not in ids[:2]
    out = greedy(client, 8, stop_token_ids=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == 3
    assert text.startswith(out.choices[0].text)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       stream=True, extra_body={"stop_token_ids": [stop]})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_min_p_one_at_temperature_two_gives_the_greedy_text(client: openai.OpenAI) -> None:
    plain = greedy(client, 12).choices[0].text
    hot = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=2.0,
                                    n=3, extra_body={"min_p": 1.0})
    assert [c.text for c in hot.choices] == [plain] * 3


def test_repetition_penalty_changes_a_repetitive_greedy_text(client: openai.OpenAI) -> None:
    prompt = "one two one two one two one two"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    penalized = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                          temperature=0, extra_body={"repetition_penalty": 2.0})
    assert penalized.choices[0].text != plain.choices[0].text
    for word in ("one", "two"):  # every token of the prompt is discouraged
        assert word not in penalized.choices[0].text.split()[:1]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client: openai.OpenAI) -> None:
    full = greedy(client, 1)
    kept = tokens(client, PROMPT)[-3:]  # "France is" and the space before it, or so
    cut = greedy(client, 4, truncate_prompt_tokens=3)
    assert full.usage is not None and cut.usage is not None
    assert full.usage.prompt_tokens > 3 and cut.usage.prompt_tokens == 3
    alone = client.completions.create(model=MODEL, prompt=kept, max_tokens=4, temperature=0)
    assert cut.choices[0].text == alone.choices[0].text  # as if only those were sent


def test_bad_controls_get_the_openai_error_shape(client: openai.OpenAI) -> None:
    for extra, status, param in (({"min_tokens": 9}, 400, "min_tokens"),
                                 ({"stop_token_ids": [10**6]}, 400, "stop_token_ids"),
                                 ({"min_p": 2}, 422, "min_p")):
        with pytest.raises(openai.APIStatusError) as exc:
            greedy(client, 8, **extra)
        assert exc.value.status_code == status
        assert exc.value.body["param"].startswith(param), exc.value.body  # type: ignore[index]
