"""The registry: Hello bounds, one tokenizer per model, opaque names, the model's context."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from gateway.engine.registry import MAX_NUM_SEQS, Registry, check_hello
from protocol import codec
from protocol import messages as m

FAKE_TOKENIZER = SimpleNamespace(vocab_size=100)  # what the registry reads of one

TOK = m.TokenizerInfo('{"model": {}}', None, None, None, [0])
OTHER_TOK = m.TokenizerInfo('{"model": {"x": 1}}', None, None, None, [0])


def hello(**kw: object) -> m.Hello:
    base = m.Hello(m.PROTOCOL_VERSION, "abc123", "tiny", 256, 4096, 8, TOK,
                   tokenizer_digest=codec.tokenizer_digest(TOK))
    return dataclasses.replace(base, **kw)


@pytest.mark.parametrize("change", [
    {"max_num_seqs": MAX_NUM_SEQS + 1}, {"max_num_seqs": 0}, {"max_model_len": 0},
    {"max_model_len": 1 << 30}, {"kv_capacity_tokens": -1}, {"block_size": 0},
    {"model_id": ""}, {"model_id": "x" * 129}, {"model_id": "bad\nname"},
    {"worker_id": "a" * 65}, {"worker_id": "a b"}, {"device": "d" * 33},
    {"dtype": 'f{"x"}'}, {"protocol_version": m.PROTOCOL_VERSION + 1},
    {"matmul_plan": "matmul plan: " + "x" * 2048}, {"matmul_plan": "matmul plan:\x1b[2J"},
])
def test_a_hello_outside_the_bounds_is_refused(change: dict) -> None:
    assert check_hello(hello(**change)) is not None


def test_a_plain_hello_passes() -> None:
    assert check_hello(hello()) is None
    assert check_hello(hello(matmul_plan="matmul plan: q4_0: int_dot 1+ (flags)")) is None


def test_a_second_worker_with_another_tokenizer_for_the_model_is_refused() -> None:
    reg = Registry()
    reg.admit(b"a", hello(), codec.tokenizer_digest(TOK), tokenizer=FAKE_TOKENIZER)  # type: ignore[arg-type]
    other = hello(tokenizer=OTHER_TOK, tokenizer_digest=codec.tokenizer_digest(OTHER_TOK))
    assert "tokenizer differs" in (reg.refuse_reason(other, codec.tokenizer_digest(OTHER_TOK))
                                   or "")
    assert reg.refuse_reason(hello(), codec.tokenizer_digest(TOK)) is None


def test_a_digest_that_does_not_match_the_tokenizer_sent_is_refused() -> None:
    reg = Registry()
    lying = hello(tokenizer=OTHER_TOK)  # claims TOK's digest, sends another tokenizer
    assert "does not match" in (reg.refuse_reason(lying, codec.tokenizer_digest(OTHER_TOK))
                                or "")


def test_the_model_context_is_the_largest_and_candidates_must_fit() -> None:
    reg = Registry()
    digest = codec.tokenizer_digest(TOK)
    small = reg.admit(b"s", hello(max_model_len=64), digest, tokenizer=FAKE_TOKENIZER)  # type: ignore[arg-type]
    big = reg.admit(b"b", hello(max_model_len=512), digest, None)
    assert reg.models["tiny"].hello.max_model_len == 512
    assert reg.candidates("tiny", 100) == [big]
    assert set(map(id, reg.candidates("tiny", 64))) == {id(small), id(big)}
    reg.drop(big)
    assert reg.models["tiny"].hello.max_model_len == 64
    reg.drop(small)
    assert "tiny" not in reg.models


def test_worker_names_are_opaque_and_never_the_worker_id() -> None:
    reg = Registry()
    digest = codec.tokenizer_digest(TOK)
    w1 = reg.admit(b"id-one", hello(worker_id="id-one"), digest, tokenizer=FAKE_TOKENIZER)  # type: ignore[arg-type]
    w2 = reg.admit(b"id-two", hello(worker_id="id-two"), digest, None)
    assert (w1.name, w2.name) == ("w1", "w2")
