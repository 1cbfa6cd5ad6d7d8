"""Codec limits, key files and address checks of the engine link."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgpack
import pytest
import zmq

from common.keygen import main as keygen_main
from protocol import codec
from protocol import messages as m
from protocol.transport import configure_dealer, is_loopback, load_public_key, load_secret_key


def test_a_token_frame_over_its_limit_is_refused_before_msgpack_reads_it() -> None:
    huge = codec.encode(m.TokenOutput("r", 0, list(range(40_000))))
    assert len(huge[1]) > codec.DEFAULT_MAX_PAYLOAD
    with pytest.raises(codec.DecodeError, match="over its limit"):
        codec.decode(huge)


def test_msgpack_containers_are_bounded() -> None:
    payload = msgpack.packb({"request_id": "r", "prompt_token_ids": [1] * (codec.MAX_ARRAY_LEN + 1),
                             "params": {}})
    with pytest.raises(codec.DecodeError):
        codec.decode([bytes([codec.TYPE_CODES[m.Generate]]), payload])
    wide = msgpack.packb({str(i): i for i in range(codec.MAX_MAP_LEN + 1)})
    with pytest.raises(codec.DecodeError):
        codec.decode([bytes([codec.TYPE_CODES[m.Cancel]]), wide])


def test_peek_type_reads_only_the_type_byte() -> None:
    assert codec.peek_type(codec.encode(m.Cancel("r"))) is m.Cancel
    assert codec.peek_type([b"\x04", b"\xc1 not msgpack"]) is m.TokenOutput
    assert codec.peek_type([b"\xff", b""]) is None
    assert codec.peek_type([b"only"]) is None


def test_the_tokenizer_digest_covers_every_field() -> None:
    base = m.TokenizerInfo("{}", "t", "<s>", "</s>", [2], False)
    digests = {codec.tokenizer_digest(t) for t in (
        base, m.TokenizerInfo("{} ", "t", "<s>", "</s>", [2], False),
        m.TokenizerInfo("{}", "u", "<s>", "</s>", [2], False),
        m.TokenizerInfo("{}", "t", "<s>", "</s>", [3], False),
        m.TokenizerInfo("{}", "t", "<s>", "</s>", [2], True))}
    assert len(digests) == 5


def test_keygen_writes_pyzmq_certificates_with_a_private_secret(tmp_path: Path) -> None:
    assert keygen_main(["worker-1", "--dir", str(tmp_path)]) == 0
    public, secret = tmp_path / "worker-1.key", tmp_path / "worker-1.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    pair = load_secret_key(secret)
    assert load_public_key(public) == pair.public and len(pair.secret) == 40
    assert keygen_main(["worker-1", "--dir", str(tmp_path)]) == 2  # no silent overwrite
    with pytest.raises(ValueError):
        load_secret_key(public)  # a public file holds no secret


def test_keygen_refuses_names_that_are_paths(tmp_path: Path) -> None:
    assert keygen_main(["../x", "--dir", str(tmp_path)]) == 2


@pytest.mark.parametrize("address, loopback", [
    ("tcp://127.0.0.1:5557", True), ("tcp://127.0.0.3:1", True), ("tcp://[::1]:5", True),
    ("tcp://localhost:5", True), ("ipc:///tmp/x", True),
    ("tcp://127.0.0.2:0;127.0.0.1:5557", True), ("tcp://0.0.0.0:5557", False),
    ("tcp://*:5557", False), ("tcp://10.0.0.5:5557", False), ("tcp://gateway:5557", False),
])
def test_is_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_link_sockets_have_a_message_size_limit_and_finite_queues() -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        configure_dealer(sock, "w")
        assert 0 < sock.getsockopt(zmq.MAXMSGSIZE) <= codec.MAX_FRAME_BYTES + 1024
        assert sock.getsockopt(zmq.SNDHWM) > 0 and sock.getsockopt(zmq.RCVHWM) > 0
    finally:
        sock.close()
