"""GatewayTokenizer against transformers' SmolLM2 tokenizer (the reference), and its own rules."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import pytest

from gateway.tokens.tokenizer import MAX_TEMPLATE_CHARS, ChatTemplateError, GatewayTokenizer
from protocol.messages import TokenizerInfo

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "system_and_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "multi_turn": [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Say 你好 and 😀, then  two spaces.\n\nAnd a new paragraph."},
    ],
}

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "The capital of France is Paris.",
    "naïve café, Zürich — “quotes” and ‘apostrophes’",
    "你好，世界。日本語のテキスト",
    "emoji: 😀👍🏽🇫🇷 and a ZWJ family 👨‍👩‍👧",
    "code:\n\tdef f(x):\n        return x ** 2\n\n\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_equals_transformers_apply_chat_template(
    smollm2: GatewayTokenizer, hf_tokenizer: Any, name: str
) -> None:
    messages = CONVERSATIONS[name]
    for add_generation_prompt in (True, False):
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == expected


def test_chat_prompt_ids_equal_transformers_tokenized_chat(
    smollm2: GatewayTokenizer, hf_tokenizer: Any
) -> None:
    messages = CONVERSATIONS["multi_turn"]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    prompt = smollm2.apply_chat_template(messages)
    assert smollm2.encode(prompt, add_special_tokens=False) == list(expected)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers_encode(
    smollm2: GatewayTokenizer, hf_tokenizer: Any, text: str
) -> None:
    assert smollm2.encode(text) == hf_tokenizer.encode(text)
    assert smollm2.encode(text, add_special_tokens=False) == hf_tokenizer.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize("text", TEXTS)
def test_decode_equals_transformers_decode(
    smollm2: GatewayTokenizer, hf_tokenizer: Any, text: str
) -> None:
    ids = smollm2.encode(text)
    for skip in (True, False):
        assert smollm2.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )
    assert smollm2.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_eos_and_vocab_size(smollm2: GatewayTokenizer) -> None:
    assert smollm2.vocab_size == 49152
    assert smollm2.eos_token_ids == (2,)  # <|im_end|>
    assert smollm2.bos_token_id == 1  # <|im_start|>, as the GGUF metadata names it
    assert smollm2.is_special(0) and smollm2.is_special(1) and smollm2.is_special(2)
    assert not smollm2.is_special(smollm2.encode("Paris")[0])
    assert smollm2.decode([2, *smollm2.encode("Hi")], skip_special_tokens=True) == "Hi"


def test_smollm2_does_not_add_bos(smollm2: GatewayTokenizer) -> None:
    assert smollm2.encode("Hello") == smollm2.encode("Hello", add_special_tokens=False)


def test_add_bos_token_prepends_bos_once(smollm2_info: TokenizerInfo) -> None:
    tok = GatewayTokenizer.from_info(dataclasses.replace(smollm2_info, add_bos_token=True))
    plain = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == [1, *plain]
    assert tok.encode("<|im_start|>Hello") == [1, *plain]  # already there: not doubled
    assert tok.encode("") == [1]


def test_content_parts_are_joined_text(smollm2: GatewayTokenizer) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
        }
    ]
    plain = [{"role": "user", "content": "Hello\nthere"}]
    assert smollm2.apply_chat_template(parts) == smollm2.apply_chat_template(plain)


def test_non_text_content_part_raises_chat_template_error(smollm2: GatewayTokenizer) -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(ChatTemplateError, match="image_url"):
        smollm2.apply_chat_template([{"role": "user", "content": [image]}])


def test_no_chat_template_raises_chat_template_error(smollm2_info: TokenizerInfo) -> None:
    tok = GatewayTokenizer.from_info(dataclasses.replace(smollm2_info, chat_template=None))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert issubclass(ChatTemplateError, ValueError)  # the gateway maps ValueError to 400
    assert tok.encode("hi") == [6004]  # completions still work


def test_template_that_does_not_compile_only_breaks_chat(smollm2_info: TokenizerInfo) -> None:
    tok = GatewayTokenizer.from_info(dataclasses.replace(smollm2_info, chat_template="{% for %}"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_over_the_limit_is_never_compiled_and_only_breaks_chat(
        smollm2_info: TokenizerInfo) -> None:
    line = "{{ messages[0].content }}\n"
    fits = _with_template(smollm2_info, line * (MAX_TEMPLATE_CHARS // len(line)))
    assert fits.has_chat_template
    start = time.monotonic()
    tok = _with_template(smollm2_info, "{% if x %}{% endif %}" * 500_000)  # 10 MB: minutes
    assert time.monotonic() - start < 5
    with pytest.raises(ChatTemplateError, match="over the gateway's limit"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.encode("hi") == [6004]


def _with_template(info: TokenizerInfo, template: str) -> GatewayTokenizer:
    return GatewayTokenizer.from_info(dataclasses.replace(info, chat_template=template))


def test_raise_exception_in_template_raises_chat_template_error(
    smollm2_info: TokenizerInfo,
) -> None:
    tok = _with_template(
        smollm2_info,
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first must be user') }}{% endif %}",
    )
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_render_error_from_bad_message_raises_chat_template_error(
    smollm2: GatewayTokenizer,
) -> None:
    with pytest.raises(ChatTemplateError):
        smollm2.apply_chat_template([{"role": "user"}])  # no content: the template cannot add it
    with pytest.raises(ChatTemplateError):
        smollm2.apply_chat_template([])


def test_template_globals_filters_and_options_match_transformers(
    smollm2_info: TokenizerInfo, hf_tokenizer: Any
) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}\n"
        "    {{ m | tojson }}|{{ m['content'] | tojson(indent=2) }}\n"
        "{% endfor %}{% if tools is not none %}TOOLS{% endif %}"
        "{% set ns = namespace(n=0) %}{% set ns.n = 3 %}{{ ns.n }}"
        "{{ strftime_now('%Y') | length }}{{ eos_token }}"
        "{% if add_generation_prompt %}<gen>{% endif %}"
    )
    messages = [
        {"role": "user", "content": "<b>&'é'</b>"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "never rendered"},
    ]
    got = _with_template(smollm2_info, template).apply_chat_template(messages)
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert got == expected
    assert "\"<b>&'é'</b>\"" in got  # tojson does not escape HTML or non-ASCII


def test_sandbox_refuses_underscore_attributes(smollm2_info: TokenizerInfo) -> None:
    tok = _with_template(smollm2_info, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ns = _with_template(smollm2_info, "{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(ChatTemplateError):
        ns.apply_chat_template([{"role": "user", "content": "hi"}])


SILENT_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}")


def test_a_template_that_loops_without_writing_stops_at_its_deadline(
        smollm2_info: TokenizerInfo) -> None:
    """Issue 23: the time bound was checked only when the template wrote something, so nested
    loops that print nothing held a thread (and, six of them, every request) for hours."""
    tok = GatewayTokenizer.from_info(dataclasses.replace(smollm2_info, chat_template=(
        "{% if messages[0].content == 'slow' %}" + SILENT_LOOPS + "{% endif %}ok")))
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="took over 0.3 s"):
        tok.apply_chat_template([{"role": "user", "content": "slow"}], timeout_s=0.3)
    assert time.monotonic() - start < 2.0
    assert sys.gettrace() is None  # the thread's trace is given back
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], timeout_s=0.3) == "ok"


def test_a_template_late_on_a_small_conversation_is_fenced(smollm2_info: TokenizerInfo) -> None:
    """Each render of a template that never ends burned a thread, and the GIL, for its whole
    timeout. Tried once when the model joins, it is refused from then on without rendering."""
    start = time.monotonic()
    broken = _with_template(smollm2_info, SILENT_LOOPS)
    assert time.monotonic() - start < 2.0  # the probe stops at its own bound
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="its chats are refused"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}], timeout_s=2.0)
    assert time.monotonic() - start < 0.1
    # late only on some small conversation: fenced from that render on
    picky = _with_template(smollm2_info, "{% if messages[0].content == 'slow' %}"
                           + SILENT_LOOPS + "{% endif %}ok")
    with pytest.raises(ChatTemplateError, match="its chats are refused"):
        picky.apply_chat_template([{"role": "user", "content": "slow"}], timeout_s=0.5)
    with pytest.raises(ChatTemplateError, match="its chats are refused"):
        picky.apply_chat_template([{"role": "user", "content": "hi"}], timeout_s=0.5)
    # late on a large conversation: that request's 400, the template stays in use
    sized = _with_template(smollm2_info, "{% for m in messages %}{% for c in m.content %}"
                           "{% for i in range(2000) %}{% endfor %}{% endfor %}{% endfor %}ok")
    with pytest.raises(ChatTemplateError, match="rendering took over 0.5 s"):
        sized.apply_chat_template([{"role": "user", "content": "x" * 20_000}], timeout_s=0.5)
    assert sized.apply_chat_template([{"role": "user", "content": "hi"}], timeout_s=0.5) == "ok"


def test_the_deadline_leaves_an_ordinary_render_alone(smollm2: GatewayTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert smollm2.apply_chat_template(messages, timeout_s=5.0) == \
        smollm2.apply_chat_template(messages)
