"""gateway/prompt/structured.py: every constraint source becomes one grammar that compiles; bad
ones, and two at once, are 400s; JSON is compact by default. Matchers run on SmolLM2's tokenizer."""

from __future__ import annotations

import asyncio
import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from gateway.http.errors import APIError
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from gateway.prompt.grammar_cache import GrammarCache
from gateway.prompt.structured import json_grammar, request_grammar
from protocol.messages import TokenizerInfo


@pytest.fixture(scope="module")
def lltok(smollm2_info: TokenizerInfo) -> LLTokenizer:
    return LLTokenizer(smollm2_info.tokenizer_json, eos_token=smollm2_info.eos_token_ids)


def accepts(lltok: LLTokenizer, grammar: str, text: str) -> bool:
    m = LLMatcher(lltok, grammar, log_level=0)
    return m.consume_tokens(lltok.tokenize_str(text)) and m.is_accepting()


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields})


def grammar_of(body: object) -> str | None:
    return asyncio.run(request_grammar(body))


def test_no_constraint_is_free_text() -> None:
    assert grammar_of(chat()) is None
    assert grammar_of(chat(response_format={"type": "text"})) is None


def test_json_schema_is_compact_by_default_and_enforced(lltok: LLTokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    g = grammar_of(chat(response_format={"type": "json_schema",
                                         "json_schema": {"name": "t", "schema": schema,
                                                         "strict": True}}))
    assert accepts(lltok, g, '{"a":1,"b":"x"}')
    assert not accepts(lltok, g, '{"a": 1, "b": "x"}')  # whitespace: not by default
    assert not accepts(lltok, g, '{"a":1,"b":"z"}')  # not in the enum
    assert not accepts(lltok, g, '{"a":1}')  # a required field missing


def test_x_guidance_in_the_schema_can_allow_whitespace(lltok: LLTokenizer) -> None:
    g = json_grammar({"type": "object", "x-guidance": {"whitespace_flexible": True}})
    assert accepts(lltok, g, '{ "k" : 1 }')


def test_vllm_names_build_their_grammars(lltok: LLTokenizer) -> None:
    assert accepts(lltok, grammar_of(chat(guided_choice=["red", "blue"])), "blue")
    assert accepts(lltok, grammar_of(chat(guided_regex=r"\d{3}")), "123")
    assert not accepts(lltok, grammar_of(chat(guided_regex=r"\d{3}")), "12a")
    assert accepts(lltok, grammar_of(chat(guided_json={"type": "integer"})), "42")
    assert accepts(lltok, grammar_of(chat(guided_json='{"type": "boolean"}')), "true")
    assert accepts(lltok, grammar_of(chat(guided_grammar='start: "a"+')), "aaa")
    assert accepts(lltok, grammar_of(chat(guided_grammar='root ::= "b" "c"')), "bc")  # GBNF
    assert accepts(lltok, grammar_of(chat(structured_outputs={"regex": "z+"})), "zz")
    assert accepts(lltok, grammar_of(chat(structured_outputs={"json_object": True})), '{"q":1}')
    body = CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["a"]})
    assert accepts(lltok, grammar_of(body), "a")


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "[not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
])
def test_bad_or_conflicting_constraints_are_400(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        grammar_of(chat(**fields))
    assert info.value.status == 400 and info.value.param == param


def test_strict_false_still_constrains(lltok: LLTokenizer) -> None:
    g = grammar_of(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "array", "items": {"type": "integer"}},
        "strict": False}}))
    assert accepts(lltok, g, "[1,2]") and not accepts(lltok, g, json.dumps({"a": 1}))


PANIC = ("thread '<unnamed>' panicked at /root/.cargo/registry/src/index/llguidance-1.2/src/"
         "json/compiler.rs:412:9:\nlimit exceeded\nstack backtrace:\n   0: rust_begin_unwind")


def test_a_library_panic_reaches_the_client_only_as_a_summary(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def panics(kind: str, value: object) -> str:
        raise ValueError(PANIC)

    monkeypatch.setattr("gateway.prompt.structured.build_checked", panics)
    # compiled before: not here
    monkeypatch.setattr("gateway.prompt.structured.CACHE", GrammarCache())
    body = CompletionRequest.model_validate({"prompt": "x", "guided_json": {"type": "object"}})
    with pytest.raises(APIError) as exc:
        asyncio.run(request_grammar(body))
    message = exc.value.message if hasattr(exc.value, "message") else str(exc.value)
    assert exc.value.status == 400 and "too large or too complex" in message
    for leak in ("panicked", "backtrace", ".rs:", "/root/", "cargo"):
        assert leak not in message


def test_summarize_keeps_a_plain_error_and_drops_paths() -> None:
    from gateway.prompt.structured import summarize

    assert summarize("unknown type 'strng'\nmore detail") == "unknown type 'strng'"
    assert "/home/" not in summarize("cannot open /home/build/x/y.json: no such file")
