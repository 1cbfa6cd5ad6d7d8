"""gateway/tokens/chat_template.py: which templates lay out tools themselves (`native_tools`), and a
conversation with tools, calls and results rendered through Qwen2.5's template exactly as
transformers renders it.

tests/data/qwen2.5_chat_template.jinja is the `tokenizer.chat_template` of
Qwen2.5-Coder-0.5B-Instruct's GGUF file (Apache-2.0, the Qwen team), as gateway.prompt.tools meets
it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gateway.tokens.chat_template import ChatTemplate
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol.messages import TokenizerInfo

QWEN = (Path(__file__).parents[2] / "data" / "qwen2.5_chat_template.jinja").read_text("utf-8")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
# Llama 3.1 style: reads `tools`, but asks for bare JSON, not <tool_call> blocks
LLAMA_LIKE = ("{% if tools %}Call one of these as {\"name\": ..., \"parameters\": ...}:\n"
              "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


@pytest.mark.parametrize("source, native", [
    (QWEN, True),
    (LLAMA_LIKE, False),
    # reads `tools` only to refuse them
    ("{% if tools %}{{ raise_exception('no tools') }}{% endif %}{{ messages[0].content }}",
     False),
    # mentions the tag but never lists the tools
    ("{% if tools %}<tool_call>{% endif %}{{ messages[0].content }}", False),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),  # no tools at all
    ("{{ messages[5].content.upper() }}", False),  # fails on the probe's one message
])
def test_native_tools_means_it_lists_the_tools_and_asks_for_tool_call_blocks(
        source: str, native: bool) -> None:
    assert ChatTemplate(source, {}).native_tools is native


def test_smollm2s_template_has_no_tools_branch(smollm2: GatewayTokenizer) -> None:
    assert smollm2.has_chat_template and not smollm2.native_tools


def _conversation(arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments("Paris")}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments("Oslo")}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_qwen_renders_tools_calls_and_results_as_transformers_does(
        smollm2_info: TokenizerInfo, hf_tokenizer: Any) -> None:
    tok = GatewayTokenizer(dataclasses.replace(smollm2_info, chat_template=QWEN))
    assert tok.native_tools
    chat = _conversation(lambda city: {"city": city})  # transformers passes a mapping
    ours = tok.apply_chat_template(chat, tools=TOOLS)
    theirs = hf_tokenizer.apply_chat_template(chat, tools=TOOLS, chat_template=QWEN,
                                              tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather"' in ours
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' in ours
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>" in ours
    bare = tok.apply_chat_template(chat[:2])
    assert "<tools>" not in bare and bare == hf_tokenizer.apply_chat_template(
        chat[:2], chat_template=QWEN, tokenize=False, add_generation_prompt=True)
