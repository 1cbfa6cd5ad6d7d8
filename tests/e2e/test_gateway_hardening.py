"""Issue 14 end to end: a real gateway (and, where a request must run, a tiny-model worker) on
loopback, attacked as a hostile client would: odd header bytes, rotated X-Forwarded-For, clients
that never read, slow headers and bodies, prompts whose template renders far more than they say.
"""

from __future__ import annotations

import socket

import httpx

from tests.procs import GatewayProc


def _raw(gw: GatewayProc, data: bytes, read: bool = True, timeout: float = 10) -> bytes:
    host, port = "127.0.0.1", gw.port
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_non_ascii_bearer_keys_are_401_and_leave_no_trace() -> None:
    with GatewayProc("--api-keys", "k1") as gw:
        gw.wait_live()
        for key in ("café".encode(), "café".encode("latin-1"), b"\xff\xfe x"):
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 2\r\n"
                    b"Authorization: Bearer " + key + b"\r\n\r\n{}")
            reply = _raw(gw, head)
            assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
            assert b"invalid_api_key" in reply
        assert httpx.get(gw.base_url + "/health/live").status_code == 200
    assert "Traceback" not in gw.output()


def test_rotating_x_forwarded_for_does_not_bypass_the_rate_limit() -> None:
    # Default: no proxy is trusted, so the client is the peer address whatever the header says.
    with GatewayProc("--rate-limit-rps", "0.1", "--rate-limit-burst", "2") as gw:
        gw.wait_live()
        statuses = [httpx.post(gw.base_url + "/v1/completions", json={"prompt": "x"},
                               headers={"X-Forwarded-For": f"10.1.0.{i}"}).status_code
                    for i in range(6)]
    assert statuses[:2] == [503, 503]  # no worker yet, but past the rate limit
    assert statuses[2:] == [429] * 4


def test_a_trusted_proxy_names_the_client() -> None:
    with GatewayProc("--rate-limit-rps", "0.1", "--rate-limit-burst", "1",
                     "--forwarded-allow-ips", "127.0.0.1") as gw:
        gw.wait_live()
        statuses = [httpx.post(gw.base_url + "/v1/completions", json={"prompt": "x"},
                               headers={"X-Forwarded-For": f"10.1.0.{i % 2}"}).status_code
                    for i in range(4)]
    assert statuses == [503, 503, 429, 429]  # two clients, one token each
