"""gateway/output/reasoning.py: <think> ... </think> apart from the answer, whole and streamed, with
tags split across chunks anywhere; the two parsers' difference on a text without <think>."""

from __future__ import annotations

import pytest

from gateway.output.reasoning import Reasoning, split

TEXT = "<think>\nLet me add: 2 + 3 = 5.\n</think>\n\nThe answer is 5."


def streamed(parser: str, chunks: list[str]) -> tuple[str, str]:
    r = Reasoning(parser)
    pieces = [p for c in chunks for p in r.feed(c)] + r.finish()
    return ("".join(t for f, t in pieces if f == "reasoning"),
            "".join(t for f, t in pieces if f == "content"))


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_whole_text_is_split_at_the_tags(parser: str) -> None:
    assert split(parser, TEXT) == ("\nLet me add: 2 + 3 = 5.\n", "\n\nThe answer is 5.")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_every_split_of_the_stream_gives_the_same_parts(parser: str, size: int) -> None:
    chunks = [TEXT[i:i + size] for i in range(0, len(TEXT), size)]
    assert streamed(parser, chunks) == split(parser, TEXT)


def test_a_partial_tag_is_held_back_and_never_sent_as_text() -> None:
    r = Reasoning("qwen3")
    assert r.feed("<th") == []
    assert r.feed("ink>ab</th") == [("reasoning", "ab")]
    assert r.feed("ink>cd") == [("content", "cd")]


def test_without_think_deepseek_r1_reads_reasoning_and_qwen3_an_answer() -> None:
    # DeepSeek-R1's template opens <think> itself: the text starts inside it
    assert split("deepseek_r1", "2 + 3 = 5.</think>Five.") == ("2 + 3 = 5.", "Five.")
    assert split("qwen3", "Five.") == (None, "Five.")
    assert split("deepseek_r1", "cut by max_tok") == ("cut by max_tok", "")  # never closed


def test_a_lone_less_than_sign_at_the_end_is_text_after_all() -> None:
    assert streamed("qwen3", ["a <", ""]) == ("", "a <")
    assert streamed("qwen3", ["<"]) == ("", "<")
    assert streamed("qwen3", ["<think>x </", "t"]) == ("x </t", "")


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="deepseek_r1"):
        Reasoning("r2")


def test_continue_final_message_cuts_at_the_message_not_at_a_lookalike_in_the_template() -> None:
    """The final text "end" is also the start of ChatML's own "<|im_end|>": the cut is where the
    message is, never inside the template's end of turn."""
    from gateway.tokens.chat_template import ChatTemplate

    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    t = ChatTemplate(chatml, {})
    for final in ("end", ">", "The capital of France is "):
        text = t.render([{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": final}], False,
                        continue_final_message=True)
        assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + final.rstrip()
