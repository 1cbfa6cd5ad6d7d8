"""Issue 40: fill-in-the-middle through /v1/completions' `suffix`, what code editors call. On the
real Qwen2.5-Coder-0.5B (its <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> tokens) the hole
in `def add(a, b): return` before a call of it is filled with `a + b`, streamed and not; a
model without FIM tokens (the default SmolLM2) answers a clear 400."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import QWEN_MODEL
from tests.procs import GatewayProc

PREFIX = "def add(a, b):\n    return"
SUFFIX = "\n\n\nprint(add(2, 3))  # 5\n"


def test_a_suffix_fills_the_middle(qwen_server: GatewayProc) -> None:
    client = openai.OpenAI(base_url=qwen_server.base_url + "/v1", api_key="unused",
                           max_retries=0, timeout=120)
    out = client.completions.create(model=QWEN_MODEL, prompt=PREFIX, suffix=SUFFIX,
                                    max_tokens=8, temperature=0)
    middle = out.choices[0].text
    assert middle.strip().startswith("a + b"), middle
    assert "print" not in middle  # the middle, not the suffix again
    streamed = client.completions.create(model=QWEN_MODEL, prompt=PREFIX, suffix=SUFFIX,
                                         max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == middle
    ids = httpx.post(qwen_server.base_url + "/tokenize", timeout=30, json={
        "model": QWEN_MODEL, "prompt": PREFIX, "add_special_tokens": False}).json()["tokens"]
    as_ids = client.completions.create(model=QWEN_MODEL, prompt=ids, suffix=SUFFIX,
                                       max_tokens=8, temperature=0)
    assert as_ids.choices[0].text == middle  # a prefix sent as token ids is the same prefix


def test_a_model_without_fim_tokens_answers_400(smollm_server: Any) -> None:
    client = openai.OpenAI(base_url=smollm_server[0].base_url + "/v1", api_key="unused",
                           max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=PREFIX, suffix=SUFFIX,
                                  max_tokens=4)
    body = exc.value.body
    assert body["param"] == "suffix" and body["code"] == "unsupported_parameter"  # type: ignore[index]
    assert "fill-in-the-middle" in body["message"]  # type: ignore[index]
