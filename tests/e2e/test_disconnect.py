"""A client that goes away stops its generation: the gateway cancels within 100 ms and the
worker samples at most one more token for it (the worker's own per-request counter)."""

from __future__ import annotations

import socket
import time

import httpx

BODY = b'{"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": true, ' \
       b'"temperature": 0, "stream": %s}'


def raw_request(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def wait_for_end(wk, n: int, timeout: float = 10) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ends = [e for e in wk.request_ends().values() if "cancel_received_ts" in e]
        if len(ends) >= n:
            return ends
        time.sleep(0.05)
    raise AssertionError(f"no cancelled request_end in the worker log:\n{wk.output()[-2000:]}")


def test_stream_disconnect_cancels_within_100ms_and_one_token(tiny_server) -> None:
    gw, wk = tiny_server
    before = len([e for e in wk.request_ends().values() if "cancel_received_ts" in e])
    sock = raw_request(gw.port, BODY % b"true")
    received = b""
    while received.count(b"data: ") < 5:
        received += sock.recv(4096)
    closed_at = time.time()
    sock.close()
    end = sorted(wait_for_end(wk, before + 1), key=lambda e: e["ts"])[-1]
    assert end["cancel_received_ts"] - closed_at < 0.1
    assert end["tokens_after_cancel"] <= 1
    assert end["finish_reasons"] == ["abort"]


def test_non_streamed_disconnect_cancels_too(tiny_server) -> None:
    gw, wk = tiny_server
    before = len([e for e in wk.request_ends().values() if "cancel_received_ts" in e])
    sock = raw_request(gw.port, BODY % b"false")
    deadline = time.monotonic() + 10
    while not httpx.get(gw.base_url + "/health").json()["queue"]["outstanding"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # let it generate a few tokens
    closed_at = time.time()
    sock.close()
    end = sorted(wait_for_end(wk, before + 1), key=lambda e: e["ts"])[-1]
    assert end["cancel_received_ts"] - closed_at < 0.1
    assert end["tokens_after_cancel"] <= 1
    assert httpx.get(gw.base_url + "/health").json()["queue"]["outstanding"] == 0
