"""Chat-template rendering is bounded in size and time (gateway/tokens/tokenizer.py).

max_prompt_chars counts only the messages' own text: 20,000 assistant messages with null content
count 0 characters (the gateway passes them as "") but render as 20,000 copies of the template's
scaffolding (over 100,000 tokens), which were tokenized in full before the context check refused
them.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from gateway.tokens.tokenizer import ChatTemplateError, GatewayTokenizer, RenderedPromptTooLong
from protocol.messages import TokenizerInfo

NULLS = [{"role": "user", "content": "x"}] + [{"role": "assistant", "content": ""}] * 20_000


def test_null_content_messages_are_stopped_by_the_rendered_size(
        smollm2: GatewayTokenizer) -> None:
    start = time.monotonic()
    with pytest.raises(RenderedPromptTooLong, match="rendered prompt is over 12288"):
        smollm2.apply_chat_template(NULLS, max_chars=12288)
    assert time.monotonic() - start < 5  # it stopped early, not after rendering everything


def test_a_normal_conversation_renders_the_same_with_bounds(smollm2: GatewayTokenizer) -> None:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert smollm2.apply_chat_template(chat, max_chars=12288, timeout_s=2.0) == \
        smollm2.apply_chat_template(chat)


def test_a_slow_template_is_stopped_by_the_time_bound(smollm2_info: TokenizerInfo) -> None:
    slow = dataclasses.replace(smollm2_info, chat_template=(
        "{% for m in messages %}{% for i in range(100000) %}{{ i }}{% endfor %}{% endfor %}"))
    tok = GatewayTokenizer(slow)
    with pytest.raises(ChatTemplateError, match="rendering took over"):
        tok.apply_chat_template([{"role": "user", "content": "x"}] * 50, timeout_s=0.05)
