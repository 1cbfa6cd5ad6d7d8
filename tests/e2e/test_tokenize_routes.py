"""Issue 40, end to end on the real SmolLM2: /tokenize and /detokenize in vLLM's shapes.

A text round-trips; a chat is tokenized as /v1/chat/completions tokenizes it (the same
prompt_tokens); bad input gets the OpenAI error shape.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai

TEXT = "The capital of France is Paris, and its river is the Seine."
MODEL = "SmolLM2-135M-Instruct"


def post(gw: Any, path: str, **body: Any) -> httpx.Response:
    return httpx.post(gw.base_url + path, json={"model": MODEL, **body}, timeout=60)


def test_a_text_round_trips_through_tokenize_and_detokenize(smollm_server: Any) -> None:
    gw, _ = smollm_server
    out = post(gw, "/tokenize", prompt=TEXT, return_token_strs=True).json()
    assert out["max_model_len"] > out["count"] == len(out["tokens"]) > 5
    assert "".join(out["token_strs"]) == TEXT
    assert post(gw, "/detokenize", tokens=out["tokens"]).json() == {"prompt": TEXT}


def test_a_chat_is_tokenized_as_the_chat_route_tokenizes_it(smollm_server: Any) -> None:
    gw, _ = smollm_server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    count = post(gw, "/tokenize", messages=messages).json()["count"]
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused")
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert answer.usage is not None and answer.usage.prompt_tokens == count


def test_bad_input_gets_the_openai_error_shape(smollm_server: Any) -> None:
    gw, _ = smollm_server
    cases = [
        (post(gw, "/tokenize", prompt=TEXT, messages=[{"role": "user", "content": "x"}]), 422),
        (post(gw, "/tokenize"), 422),
        (post(gw, "/detokenize", tokens=[10**6]), 400),
        (post(gw, "/detokenize", tokens=[-1]), 422),
        (httpx.post(gw.base_url + "/tokenize", json={"model": "nope", "prompt": "x"},
                    timeout=60), 404),
    ]
    for resp, status in cases:
        assert resp.status_code == status, (status, resp.text)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
