"""IncrementalDetokenizer on SmolLM2's byte-level tokenizer: UTF-8 holdback, stop strings, and the
invariant that any split of the ids into add() calls gives the non-incremental result."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.output.detokenize import IncrementalDetokenizer
from gateway.tokens.tokenizer import GatewayTokenizer

REPLACEMENT = "\ufffd"


def reference(text: str, stops: Sequence[str]) -> str:
    """The non-incremental answer: `text` cut at the stop occurrence that is completed first
    (smallest end), ties going to the one that starts first (the longest)."""
    found = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
    return text[: min(found)[1]] if found else text


def run(
    tok: GatewayTokenizer,
    chunks: Sequence[Sequence[int]],
    stop: Sequence[str] | None = None,
    skip_special_tokens: bool = True,
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `chunks` one add() at a time, then flush; return the detokenizer and every piece."""
    detok = IncrementalDetokenizer(tok, list(stop) if stop else None, skip_special_tokens)
    pieces = [detok.add(list(chunk)) for chunk in chunks]
    pieces.append(detok.flush())
    return detok, pieces


def one_by_one(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


def test_multibyte_chars_split_across_tokens_never_emit_replacement_char(
    smollm2: GatewayTokenizer,
) -> None:
    text = "Hi 😀 and 你好世界 ok 👨‍👩‍👧!"
    ids = smollm2.encode(text)
    assert len(smollm2.encode("😀")) > 1  # the premise: one character, several tokens
    assert any(REPLACEMENT in smollm2.decode([i]) for i in ids)
    detok, pieces = run(smollm2, one_by_one(ids))
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert "".join(pieces) == detok.text == smollm2.decode(ids) == text


def test_partial_char_is_held_until_its_last_byte_arrives(smollm2: GatewayTokenizer) -> None:
    ids = smollm2.encode(" 😀")
    detok = IncrementalDetokenizer(smollm2)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == " 😀"


def test_flush_decodes_a_trailing_incomplete_char_as_the_tokenizer_does(
    smollm2: GatewayTokenizer,
) -> None:
    ids = smollm2.encode("ok 😀")[:-1]  # generation ended (length) inside the emoji
    detok, pieces = run(smollm2, one_by_one(ids))
    assert pieces[-1].endswith(REPLACEMENT)
    assert "".join(pieces) == smollm2.decode(ids)


def test_leading_spaces_and_newlines_match_full_decode(smollm2: GatewayTokenizer) -> None:
    text = "  two leading spaces\n\n\tand a tab, then   three spaces "
    ids = smollm2.encode(text)
    for size in (1, 2, 3, len(ids)):
        chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
        assert "".join(run(smollm2, chunks)[1]) == smollm2.decode(ids) == text


def test_stop_string_split_across_tokens_is_never_emitted(smollm2: GatewayTokenizer) -> None:
    ids = smollm2.encode("The capital of France is Paris. It is big.")
    stop = "Paris."
    assert [smollm2.decode([i]) for i in ids][5:7] == [" Paris", "."]  # begins mid-token, spans 2
    detok = IncrementalDetokenizer(smollm2, [stop])
    pieces = []
    for i in ids:
        pieces.append(detok.add([i]))
        assert "P" not in detok.text  # no part of the stop string leaves, ever
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == "The capital of France is "
    assert detok.stopped and detok.matched_stop == stop and detok.finished


def test_stop_string_spanning_many_tokens(smollm2: GatewayTokenizer) -> None:
    ids = smollm2.encode("The capital of France is Paris. It is big.")
    detok, pieces = run(smollm2, one_by_one(ids), stop=["of France is Par"])
    assert "".join(pieces) == "The capital "
    assert detok.matched_stop == "of France is Par"


def test_tokens_after_a_stop_are_ignored(smollm2: GatewayTokenizer) -> None:
    detok = IncrementalDetokenizer(smollm2, ["."])
    assert detok.add(smollm2.encode("Paris. More")) == "Paris"
    assert detok.stopped
    assert detok.add(smollm2.encode(" text")) == ""
    assert detok.flush() == ""
    assert detok.text == "Paris"


def test_false_start_of_a_stop_string_is_emitted_in_full(smollm2: GatewayTokenizer) -> None:
    text = "I love Parisian food."
    ids = smollm2.encode(text)  # "I", " love", " Paris", "ian", " food", "."
    detok = IncrementalDetokenizer(smollm2, ["Paris."])
    assert detok.add(ids[:3]) == "I love "  # "Paris" might begin "Paris.": held
    assert detok.add(ids[3:4]) == "Parisian"  # it did not: released
    assert detok.add(ids[4:]) == " food."
    assert detok.flush() == ""
    assert detok.text == text and not detok.stopped and detok.matched_stop is None


def test_flush_releases_a_held_tail_that_never_became_a_stop(smollm2: GatewayTokenizer) -> None:
    ids = smollm2.encode("The capital of France is Paris")
    detok, pieces = run(smollm2, one_by_one(ids), stop=["Paris."])
    assert pieces[-1] == "Paris"
    assert detok.text == "The capital of France is Paris" and not detok.stopped


def test_first_completed_stop_wins_whatever_the_chunking(smollm2: GatewayTokenizer) -> None:
    ids = smollm2.encode("xx abcd yy")
    for chunks in (one_by_one(ids), [ids]):
        detok, pieces = run(smollm2, chunks, stop=["abcd", "bc"])
        assert "".join(pieces) == "xx a" and detok.matched_stop == "bc"
    # Two stops completed by the same character: the longer one cuts, so nothing of either leaks.
    detok, pieces = run(smollm2, [ids], stop=["cd", "abcd"])
    assert "".join(pieces) == "xx " and detok.matched_stop == "abcd"


def test_special_tokens_skipped_or_kept(smollm2: GatewayTokenizer) -> None:
    ids = [*smollm2.encode("Hello"), 2, *smollm2.encode(" there")]  # 2 is <|im_end|>
    assert "".join(run(smollm2, one_by_one(ids))[1]) == "Hello there"
    kept = run(smollm2, one_by_one(ids), skip_special_tokens=False)[1]
    assert "".join(kept) == "Hello<|im_end|> there"
    detok, _ = run(smollm2, one_by_one(ids), stop=["<|im_end|>"], skip_special_tokens=False)
    assert detok.text == "Hello" and detok.stopped


def test_empty_and_duplicate_stop_strings_are_ignored(smollm2: GatewayTokenizer) -> None:
    detok, pieces = run(smollm2, [smollm2.encode("a.b")], stop=["", ".", "."])
    assert "".join(pieces) == "a" and detok.matched_stop == "."


def test_add_after_flush_raises(smollm2: GatewayTokenizer) -> None:
    detok = IncrementalDetokenizer(smollm2)
    detok.add(smollm2.encode("hi"))
    assert detok.flush() == ""
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add([42])


# --- the invariant, by property ---------------------------------------------------------------

TEXT = st.lists(
    st.one_of(
        st.sampled_from(list(" \n\tabcdeParis.,!?'")),  # small alphabet: stops recur, false starts
        st.characters(codec="utf-8"),
        st.sampled_from(["😀", "你", "好", "é", "👍🏽", "\u200d", "🇫🇷", "ß", "–", " Paris", "  "]),
    ),
    max_size=40,
).map("".join)


def _split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@st.composite
def _stops(draw: st.DrawFn, text: str) -> list[str]:
    """Up to 4 stop strings: mostly substrings of `text` (which may or may not be hit first),
    sometimes arbitrary text (which almost never matches but may be held as a prefix)."""
    stops = []
    for _ in range(draw(st.integers(0, 4))):
        if text and draw(st.booleans()):
            a = draw(st.integers(0, len(text) - 1))
            b = draw(st.integers(a + 1, min(len(text), a + 8)))
            stops.append(text[a:b])
        else:
            stops.append(draw(st.text(min_size=1, max_size=4)))
    return stops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), text=TEXT, cuts=st.lists(st.integers(0, 200), max_size=20))
def test_any_chunking_of_encoded_text_equals_full_decode_cut_at_first_stop(
    smollm2: GatewayTokenizer, data: st.DataObject, text: str, cuts: list[int]
) -> None:
    ids = smollm2.encode(text)
    full = smollm2.decode(ids)
    stops = data.draw(_stops(full))
    detok, pieces = run(smollm2, _split(ids, cuts), stops)
    assert "".join(pieces) == detok.text == reference(full, stops)
    assert detok.stopped == any(s in full for s in stops)
    assert not any(REPLACEMENT in p for p in pieces if REPLACEMENT not in full)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    ids=st.lists(st.integers(0, 49151), max_size=30),
    cuts=st.lists(st.integers(0, 200), max_size=20),
    skip=st.booleans(),
)
def test_any_chunking_of_arbitrary_ids_equals_full_decode_cut_at_first_stop(
    smollm2: GatewayTokenizer,
    data: st.DataObject,
    ids: list[int],
    cuts: list[int],
    skip: bool,
) -> None:
    # Arbitrary ids: what a model may really emit, invalid UTF-8 and special tokens included.
    full = smollm2.decode(ids, skip_special_tokens=skip)
    stops = data.draw(_stops(full))
    detok, pieces = run(smollm2, _split(ids, cuts), stops, skip_special_tokens=skip)
    assert "".join(pieces) == detok.text == reference(full, stops)


def _ids(tok: GatewayTokenizer, *tokens: str) -> list[int]:
    ids = [tok.token_to_id(t) for t in tokens]
    assert None not in ids
    return ids  # type: ignore[return-value]


def _byte_tokens(char: str) -> tuple[str, ...]:
    return tuple(f"<0x{b:02X}>" for b in char.encode())


def test_position_dependent_leading_space_matches_full_decode(metaspace: GatewayTokenizer) -> None:
    # decode(["▁world"]) is "world": the decoder drops a sequence's leading space, so decoding
    # token by token would lose every space. The prefix window keeps it.
    ids = _ids(metaspace, "▁Hello", "▁world", "!")
    assert metaspace.decode(ids[1:2]) == "world"
    detok, pieces = run(metaspace, one_by_one(ids))
    assert pieces == ["Hello", " world", "!", ""]
    assert detok.text == metaspace.decode(ids) == "Hello world!"


def test_byte_fallback_char_is_held_until_complete(metaspace: GatewayTokenizer) -> None:
    ids = _ids(metaspace, "▁Hello", *_byte_tokens("😀"))
    detok, pieces = run(metaspace, one_by_one(ids))
    assert pieces == ["Hello", "", "", "", "😀", ""]
    assert detok.text == metaspace.decode(ids) == "Hello😀"


# Units of generation: words, specials, and whole characters spelled as byte-fallback tokens
# (cut apart by the chunking). Only VALID UTF-8: on an invalid run of byte tokens, the
# ByteFallback decoder turns every byte of the run into U+FFFD, valid ones included, so a full
# decode would retract characters a stream has already sent (a documented limitation).
METASPACE_UNITS = [
    *(("<unk>",), ("<s>",), ("</s>",)),
    *((w,) for w in ("▁Hello", "▁world", "▁", "!", "Par", "is", ".", "▁Paris", "▁▁", "é")),
    *(_byte_tokens(c) for c in (" ", "A", "é", "😀", "你")),
]


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    units=st.lists(st.sampled_from(METASPACE_UNITS), max_size=20),
    cuts=st.lists(st.integers(0, 200), max_size=20),
    skip=st.booleans(),
)
def test_any_chunking_on_a_metaspace_tokenizer_equals_full_decode_cut_at_first_stop(
    metaspace: GatewayTokenizer,
    data: st.DataObject,
    units: list[tuple[str, ...]],
    cuts: list[int],
    skip: bool,
) -> None:
    ids = _ids(metaspace, *(token for unit in units for token in unit))
    full = metaspace.decode(ids, skip_special_tokens=skip)
    stops = data.draw(_stops(full))
    detok, pieces = run(metaspace, _split(ids, cuts), stops, skip_special_tokens=skip)
    assert "".join(pieces) == detok.text == reference(full, stops)


@pytest.mark.parametrize("split", ["one_by_one", "at_once"])
def test_include_stop_str_in_output_ends_the_text_after_the_stop(
        smollm2: GatewayTokenizer, split: str) -> None:
    """Issue 40: vLLM's include_stop_str_in_output: the matched stop string is kept, nothing
    after it, however the ids arrive."""
    ids = smollm2.encode("The capital of France is Paris. It is big.")
    chunks = one_by_one(ids) if split == "one_by_one" else [ids]
    detok = IncrementalDetokenizer(smollm2, ["Paris."], keep_stop=True)
    pieces = [detok.add(list(c)) for c in chunks] + [detok.flush()]
    assert "".join(pieces) == detok.text == "The capital of France is Paris."
    assert detok.stopped and detok.matched_stop == "Paris."
