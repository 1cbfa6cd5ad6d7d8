"""Peers that play one side of the engine link by hand, with real ZeroMQ and the real codec.

    FakeWorker(address).hello(tiny_hello(model_dir, ...)) -> Welcome, then send/recv frames
    as a worker would (or as an attacker who reached the port would).
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import zmq

from protocol import codec
from protocol import messages as m
from protocol.transport import KeyPair


def tiny_hello(model_dir: Path, **overrides: Any) -> m.Hello:
    """The Hello a real worker of `model_dir` sends (its tokenizer and digest), with changes."""
    from engine_worker.model.tokenizer import tokenizer_info  # no torch: plain json reads

    info = overrides.pop("tokenizer", None) or tokenizer_info(model_dir)
    hello = m.Hello(m.PROTOCOL_VERSION, uuid.uuid4().hex, model_dir.name, 256, 4096, 8, info,
                    tokenizer_digest=codec.tokenizer_digest(info))
    return dataclasses.replace(hello, **overrides)


class FakeWorker:
    def __init__(self, address: str, keys: KeyPair | None = None,
                 server_key: bytes | None = None, identity: bytes | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity or uuid.uuid4().hex.encode())
        if keys is not None and server_key is not None:
            self.sock.curve_serverkey = server_key
            self.sock.curve_publickey = keys.public
            self.sock.curve_secretkey = keys.secret
        self.sock.connect(address)

    def send(self, msg: Any) -> bool:
        """False when the socket would not take it (e.g. its handshake was refused)."""
        try:
            self.sock.send_multipart(codec.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def recv(self, timeout_s: float = 5.0) -> Any | None:
        """The next message, or None if none arrives in time."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return codec.decode(self.sock.recv_multipart())

    def recv_all(self, timeout_s: float) -> list[Any]:
        out = []
        while (msg := self.recv(timeout_s)) is not None:
            out.append(msg)
        return out

    def hello(self, hello: m.Hello, timeout_s: float = 10.0) -> m.Welcome | None:
        self.send(hello)
        while (msg := self.recv(timeout_s)) is not None:
            if isinstance(msg, m.Welcome):
                return msg
        return None

    def close(self) -> None:
        self.sock.close()
