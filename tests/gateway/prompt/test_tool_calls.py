"""gateway/prompt/tool_calls.py: `<tool_call>` blocks (and bare JSON calls) read from a whole output
and from a stream split anywhere; the stream says what the whole output says, and never leaks
tags."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.prompt.tool_calls import CallStream, call_deltas, parse_calls

NAMES = {"get_weather", "get_time"}
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOKYO = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n</tool_call>'

# (output, content, [(name, arguments)]); calls None: not tool calls, the text is the content
CASES: list[tuple[str, str | None, list[tuple[str, dict]] | None]] = [
    (PARIS, None, [("get_weather", {"city": "Paris"})]),
    ("\n" + PARIS + "\n", None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n\n" + PARIS, "Let me check.", [("get_weather", {"city": "Paris"})]),
    (PARIS + "\n" + TOKYO, None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Asia/Tokyo"})]),
    # the last block without its closing tag: a model that ends its turn after the JSON
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    # arguments as JSON text
    ('<tool_call>{"name":"get_weather","arguments":"{\\"city\\": \\"Oslo\\"}"}</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
    # bare, as Qwen2.5-Coder writes its calls
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    # not calls
    ("It is sunny in Paris.", None, None),
    ("a < b and <tool but not a call", None, None),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, None),  # cut off
    ('<tool_call>\n{"name": get_weather}\n</tool_call>', None, None),  # malformed JSON
    ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', None, None),  # unknown
    ('<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>', None, None),
    (PARIS + "\nDone, it is sunny.", None, None),  # text after a call
    (PARIS + "\n<tool_call>\n{oops}\n</tool_call>", None, None),  # one bad block of two
    ('{"name": "get_weather", "arguments": {}, "extra": 1}', None, None),  # bare: exact shape
    ('{"name": "Paris", "arguments": {}}', None, None),
    ('{"city": "Paris"}', None, None),
]


def whole(text: str, finish: str = "stop") -> tuple[str | None, list[tuple[str, dict]] | None,
                                                     str]:
    parsed = parse_calls(text, NAMES)
    if parsed is None:
        return text, None, finish
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in parsed.calls]
    return parsed.content, calls, "tool_calls"


def streamed(pieces: list[str], finish: str = "stop"
             ) -> tuple[str | None, list[tuple[str, dict]] | None, str | None]:
    """What a client assembles from the stream's deltas."""
    stream = CallStream(NAMES)
    deltas: list[dict[str, Any]] = []
    end = None
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        out, reason = stream.feed(piece, finish if last else None)
        assert last or reason is None
        deltas += out
        end = reason if last else end
    content = "".join(d.get("content", "") for d in deltas) or None
    by_index: dict[int, list[str]] = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            slot = by_index.setdefault(call["index"], ["", ""])
            slot[0] += call.get("function", {}).get("name", "")
            slot[1] += call.get("function", {}).get("arguments", "")
            if "id" in call:
                assert call["id"].startswith("call_") and call["type"] == "function"
    calls = [(name, json.loads(args)) for name, args in
             (by_index[i] for i in sorted(by_index))] or None
    return content, calls, end


@pytest.mark.parametrize("text, content, calls", CASES)
def test_parse_reads_calls_or_leaves_the_text(text: str, content: str | None,
                                              calls: list | None) -> None:
    got_content, got_calls, finish = whole(text)
    assert got_calls == calls
    if calls is None:
        assert (got_content, finish) == (text, "stop")
    else:
        assert (got_content, finish) == (content, "tool_calls")


@pytest.mark.parametrize("text, content, calls", CASES)
def test_a_stream_split_at_every_boundary_says_what_the_whole_text_says(
        text: str, content: str | None, calls: list | None) -> None:
    expected = whole(text)
    assert streamed([text]) == expected
    assert streamed(list(text)) == expected  # one character at a time
    for cut in range(len(text) + 1):
        assert streamed([text[:cut], text[cut:]]) == expected, cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(pieces) == expected, pieces


def test_content_before_a_call_is_sent_as_it_comes_and_no_tag_text_is() -> None:
    stream = CallStream(NAMES)
    assert stream.feed("Let me", None) == ([{"content": "Let me"}], None)
    assert stream.feed(" check.\n<tool", None) == ([{"content": " check."}], None)
    assert stream.feed("_call>\n{", None) == ([], None)  # a call: held to the end
    deltas, finish = stream.feed(PARIS[len("<tool_call>\n{"):], "stop")
    assert finish == "tool_calls" and not any("content" in d for d in deltas)
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0]


def test_a_tag_that_does_not_come_is_let_go_and_an_unfinished_call_is_text() -> None:
    stream = CallStream(NAMES)
    assert stream.feed("x <tool_c", None) == ([{"content": "x"}], None)
    assert stream.feed("ar", None) == ([{"content": " <tool_car"}], None)
    cut = CallStream(NAMES)
    assert cut.feed(PARIS[:30], None) == ([], None)
    assert cut.feed(PARIS[30:40], "length") == ([{"content": PARIS[:40]}], "length")


def test_call_deltas_give_each_call_its_index_name_then_arguments() -> None:
    parsed = parse_calls(PARIS + "\n" + TOKYO, NAMES)
    assert parsed is not None
    deltas = call_deltas(parsed.calls)
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0, 1, 1]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[3]["tool_calls"][0] == {"index": 1, "function": {
        "arguments": '{"timezone":"Asia/Tokyo"}'}}
    assert len({parsed.calls[0]["id"], parsed.calls[1]["id"]}) == 2
