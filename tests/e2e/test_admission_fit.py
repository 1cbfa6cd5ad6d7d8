"""Issue 27 end to end: admit only what can finish. The real SmolLM2 behind the real gateway and
worker, through the official openai client.

A plain request (no max_tokens) completes with 200 on every route: its default is the route's
(16 for completions and /v1/generate; for chat the rest of the context, within the cap), with no
deadline unless it asks one. A request whose max_tokens cannot fit its timeout gets 400 at once,
never a 504 when its deadline passes.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.smollm

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def gw(smollm_server):  # noqa: ANN001, ANN201
    return smollm_server[0]


def test_plain_requests_without_max_tokens_complete(gw) -> None:  # noqa: ANN001
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="x", max_retries=0)
    done = client.completions.create(model=MODEL, prompt="0")
    assert done.choices[0].finish_reason in ("stop", "length")
    assert 1 <= done.usage.completion_tokens <= 16
    native = httpx.post(gw.base_url + "/v1/generate", json={"prompt": "0"}, timeout=60)
    assert native.status_code == 200, native.text
    assert 1 <= native.json()["completion_tokens"] <= 16
    # Greedy: sampled at temperature 1, one of the 7 could ramble to the end of the context
    # (30 s of the suite) without asserting anything more; each still names no max_tokens.
    chat = client.chat.completions.create(
        model=MODEL, n=7, temperature=0, messages=[{"role": "user", "content": "Say hello."}])
    assert len(chat.choices) == 7
    assert all(c.finish_reason in ("stop", "length") for c in chat.choices)


def test_max_tokens_that_cannot_fit_the_timeout_is_a_400_at_once(gw) -> None:  # noqa: ANN001
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="x", max_retries=0)
    for _ in range(2):  # the worker's rates are measured from requests that ran
        client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=8)
    start = time.monotonic()
    resp = httpx.post(gw.base_url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 1000, "ignore_eos": True,
        "timeout": 2})
    elapsed = time.monotonic() - start
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "deadline_unreachable" and error["param"] == "max_tokens"
    assert "max_tokens=1000" in error["message"] and "timeout" in error["message"]
    assert elapsed < 2.0  # at once: not after the 2 s deadline
    # The same max_tokens with room for it is admitted and completes (no 504 either way).
    ok = httpx.post(gw.base_url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 40, "timeout": 60})
    assert ok.status_code == 200, ok.text


def test_a_deadline_shorter_than_anything_is_a_400_not_a_504(gw) -> None:  # noqa: ANN001
    resp = httpx.post(gw.base_url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "0", "max_tokens": 4, "timeout": 1e-6})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] in ("timeout", "max_tokens")
