"""The codec: every message round-trips; anything malformed is a DecodeError, never a crash."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import codec
from protocol import messages as m

TOKENIZER = m.TokenizerInfo('{"model": {}}', "{{ messages }}", "<s>", "</s>", [2, 3], True)
SAMPLES = [
    m.Hello(m.PROTOCOL_VERSION, "w1", "tiny", 2048, 4096, 32, TOKENIZER, "cpu", "bfloat16",
            "int8", 1234),
    m.Welcome(m.PROTOCOL_VERSION, False, "version mismatch"),
    m.Generate("r1", [1, 2, 3], m.SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9,
                                                 top_k=4, seed=7, stop_token_ids=[9],
                                                 logprobs=2, n=3), 1.7e9),
    m.Generate("r2", [4], m.SamplingParams()),
    m.TokenOutput("r1", 2, [5, 6], "length", 3, 2, [[5, -0.5, [[5, -0.5], [8, -1.25]]]], 16),
    m.TokenOutput("r1", 0, [7]),
    m.StepOutputs([m.TokenOutput("r1", 2, [5, 6], "length", 3, 2,
                                 [[5, -0.5, [[5, -0.5], [8, -1.25]]]], 16, 0.25),
                   m.TokenOutput("r2", 0, [7])]),
    m.StepOutputs([]),
    m.RequestError("r1", "too long", "invalid_request"),
    m.Cancel("r1"),
    m.Heartbeat("w1", m.Stats(1, 2, 3, 4, 5, 6, 7, 8, 9), 12.5, True),
    m.Reset("who are you"),
    m.WorkerDying("w1", "engine error"),
    m.ProtocolError("bad frame"),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(s) for s in SAMPLES} == set(codec.TYPE_CODES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip_gives_an_equal_message(msg: object) -> None:
    frames = codec.encode(msg)
    assert len(frames) == 2 and len(frames[0]) == 1
    assert codec.decode(frames) == msg


def test_type_codes_are_distinct() -> None:
    assert len(set(codec.TYPE_CODES.values())) == len(codec.TYPE_CODES)


def test_encoding_a_non_message_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        codec.encode({"request_id": "r"})


@pytest.mark.parametrize("frames", [
    [],
    [b"\x06"],
    [b"\x06", b"", b""],
    [b"\xff", msgpack.packb({"request_id": "r"})],
    [b"\x06\x06", msgpack.packb({"request_id": "r"})],
    [b"\x06", b"\xc1garbage"],
    [b"\x06", msgpack.packb([1, 2])],
    [b"\x06", msgpack.packb({})],
    [b"\x06", msgpack.packb({"request_id": 5})],
    [b"\x03", msgpack.packb({"request_id": "r", "prompt_token_ids": ["a"], "params": {}})],
    [b"\x03", msgpack.packb({"request_id": "r", "prompt_token_ids": [1], "params": 3})],
    [b"\x07", msgpack.packb({"worker_id": "w", "stats": {"running": True}})],
    # typed token frames: a finish reason outside the four, logprob entries of the wrong shape
    [b"\x04", msgpack.packb({"request_id": "r", "index": 0, "token_ids": [1],
                             "finish_reason": "done"})],
    [b"\x04", msgpack.packb({"request_id": "r", "index": 0, "token_ids": [1],
                             "logprobs": [[1, -0.5]]})],
    [b"\x04", msgpack.packb({"request_id": "r", "index": 0, "token_ids": [1],
                             "logprobs": [[1, "-0.5", []]]})],
    [b"\x04", msgpack.packb({"request_id": "r", "index": 0, "token_ids": [1],
                             "logprobs": [[1, -0.5, [[2, -1.0, 3]]]]})],
    # step frames: positional rows, each checked as strictly as a TokenOutput map
    [b"\x0b", msgpack.packb({"outputs": []})],
    [b"\x0b", msgpack.packb([["r", 0, [1]]])],
    [b"\x0b", msgpack.packb([["r", True, [1], None, 0, 0, None, 0, None]])],
    [b"\x0b", msgpack.packb([["r", 0, [True], None, 0, 0, None, 0, None]])],
    [b"\x0b", msgpack.packb([["r", 0, ["1"], None, 0, 0, None, 0, None]])],
    [b"\x0b", msgpack.packb([[5, 0, [1], None, 0, 0, None, 0, None]])],
    [b"\x0b", msgpack.packb([["r", 0, [1], "done", 0, 0, None, 0, None]])],
    [b"\x0b", msgpack.packb([["r", 0, [1], None, 0, 0, [[1, -0.5]], 0, None]])],
    [b"\x0b", msgpack.packb([["r", 0, [1], None, 0, 0, None, 0, "soon"]])],
    [b"\x0b", msgpack.packb([["r", 0, [1], None, 0, 1.5, None, 0, None]])],
], ids=lambda f: repr(f)[:40])
def test_malformed_frames_raise_decode_error(frames: list[bytes]) -> None:
    with pytest.raises(codec.DecodeError):
        codec.decode(frames)


@pytest.mark.parametrize("reason", ["stop", "length", "abort", "timeout"])
def test_every_finish_reason_the_worker_sends_decodes(reason: str) -> None:
    frames = codec.encode(m.TokenOutput("r", 0, [1], reason))  # type: ignore[arg-type]
    assert codec.decode(frames).finish_reason == reason


def test_unknown_fields_are_ignored_within_a_version() -> None:
    payload = msgpack.packb({"request_id": "r", "added_later": 1})
    assert codec.decode([b"\x06", payload]) == m.Cancel("r")


def test_a_step_row_with_fields_added_later_still_decodes() -> None:
    payload = msgpack.packb([["r", 0, [1], "stop", 2, 1, None, 0, None, None, "added later"]])
    assert codec.decode([b"\x0b", payload]) == m.StepOutputs([m.TokenOutput("r", 0, [1], "stop",
                                                                             2, 1)])


def test_an_embedding_travels_as_float32_bytes_and_a_ragged_one_is_refused() -> None:
    vector = bytes(range(16))
    out = m.TokenOutput("r", 1, [], "stop", 7, 0, embedding=vector)
    assert codec.decode(codec.encode(m.StepOutputs([out]))) == m.StepOutputs([out])
    for bad in (b"\x00" * 6, "text"):
        payload = msgpack.packb([["r", 0, [], "stop", 2, 0, None, 0, None, bad]],
                                use_bin_type=True)
        with pytest.raises(codec.DecodeError, match="embedding"):
            codec.decode([b"\x0b", payload])


def test_a_step_of_64_sequences_is_one_message_smaller_than_64_token_frames() -> None:
    outs = [m.TokenOutput(f"{i:012x}-{i}", 0, [1000 + i], None, 12, 40) for i in range(64)]
    step = codec.encode(m.StepOutputs(outs))
    assert codec.decode(step) == m.StepOutputs(outs)
    assert len(step[1]) < sum(len(codec.encode(o)[1]) for o in outs) / 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1),
                                   st.text(max_size=3),
                                   st.lists(st.integers(0, 2**32), max_size=3)), max_size=10),
                max_size=3))
def test_random_step_rows_never_raise_anything_but_decode_error(rows: list) -> None:
    try:
        codec.decode([b"\x0b", msgpack.packb(rows)])
    except codec.DecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_bytes_never_raise_anything_but_decode_error(frames: list[bytes]) -> None:
    try:
        codec.decode(frames)
    except codec.DecodeError:
        pass
