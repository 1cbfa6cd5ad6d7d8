"""Issue 40: `--reasoning-parser`, end to end through the real gateway and worker with the
official openai client. A tiny model whose chat template opens `<think>` (as DeepSeek-R1's
does) and whose output is held to `<think>thinking</think>answer` by a regex: the thinking
comes back as `reasoning_content` and `reasoning`, the answer as `content`, streamed and not,
although the tags are several tokens each; a grammar's answer is not read as thinking; an
earlier answer's reasoning sent back is accepted and kept out of the prompt."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.procs import GatewayProc, WorkerProc

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
            "{% endif %}")
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
MODEL = "tiny-llama-seed0"


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[openai.OpenAI, GatewayProc]]:
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(TEMPLATE)
    with GatewayProc("--reasoning-parser", "deepseek_r1") as gw, WorkerProc(
            tiny_model_dir, gw.engine_address, "--chat-template", str(template)):
        gw.wait_ready()
        yield openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0), gw


def ask(client: openai.OpenAI, regex: str, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                          temperature=0, extra_body={"guided_regex": regex}, **kw)


def test_the_thinking_comes_back_apart_streamed_and_not(client: Any) -> None:
    # The regex is how a random model is made to think; under a grammar the parser reads only a
    # text that opens <think> itself as thinking (gateway/prompt/intake.py's reasoning_parser; the
    # template-opened reading of deepseek_r1 is in tests/gateway/output/test_reasoning.py).
    regex = r"<think>[a-z]{2,5}</think>[a-z]{1,5}"
    api, gw = client
    tags = httpx.post(gw.base_url + "/tokenize", json={"prompt": "<think></think>",
                                                       "add_special_tokens": False}, timeout=30)
    assert tags.json()["count"] > 2  # each tag is several tokens for this tokenizer
    msg = ask(api, regex).choices[0].message
    extra = msg.model_extra or {}
    assert re.fullmatch(r"[a-z]{2,5}", extra["reasoning_content"]), msg
    assert extra["reasoning"] == extra["reasoning_content"]
    assert re.fullmatch(r"[a-z]{1,5}", msg.content or ""), msg
    reasoning, reasoning_new, content = [], [], []
    for chunk in ask(api, regex, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        reasoning_new.append((delta.model_extra or {}).get("reasoning") or "")
        content.append(delta.content or "")
    assert "".join(reasoning) == "".join(reasoning_new) == extra["reasoning_content"]
    assert "".join(content) == msg.content


def test_reasoning_sent_back_is_accepted_and_kept_out_of_the_prompt(client: Any) -> None:
    api, _ = client
    history = [*ASK, {"role": "assistant", "content": "5"}, {"role": "user", "content": "Why?"}]
    plain = api.chat.completions.create(model=MODEL, messages=history, max_tokens=1)
    for name in ("reasoning_content", "reasoning"):
        history[1] = {"role": "assistant", "content": "5", name: "long hidden thinking " * 20}
        out = api.chat.completions.create(model=MODEL, messages=history, max_tokens=1)
        assert out.usage is not None and plain.usage is not None
        assert out.usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_grammar_turns_the_parser_off(client: Any) -> None:
    """A grammar holds the text from its first token, so it has no thinking: the answer stays
    the content (deepseek_r1 would read a text without </think> as all thinking)."""
    api, _ = client
    out = api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0,
                                      extra_body={"guided_choice": ["five", "six"]})
    msg = out.choices[0].message
    assert msg.content in ("five", "six") and "reasoning_content" not in (msg.model_extra or {})
