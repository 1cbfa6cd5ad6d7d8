"""API-key checks (Auth.check_key) against hostile Authorization headers.

A header is whatever bytes the client sent; Starlette hands them over latin-1-decoded, so a
"non-ASCII" key reaches us as a str that hmac.compare_digest refuses with TypeError (a 500 before
the fix). Every header value must give the caller's key or a 401, never another exception.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from gateway.config import GatewayConfig
from gateway.http.errors import APIError
from gateway.service import GatewayState


def request(raw: bytes) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [(b"authorization", raw)], "client": ("10.0.0.1", 1)})


@pytest.fixture(scope="module")
def state() -> GatewayState:
    return GatewayState(GatewayConfig(api_keys="k1,clé-é"))


@pytest.mark.parametrize("raw", ["Bearer café".encode(), "Bearer café".encode("latin-1"),
                                 b"Bearer \xff\xfe", "Bearer 😀".encode()])
def test_a_non_ascii_key_is_a_401_not_a_crash(state: GatewayState, raw: bytes) -> None:
    with pytest.raises(APIError) as exc:
        state.auth.check_key(request(raw))
    assert exc.value.status == 401


def test_a_configured_utf8_key_still_matches(state: GatewayState) -> None:
    assert state.auth.check_key(request(b"Bearer k1")) == "k1"
    assert state.auth.check_key(request("Bearer clé-é".encode())) is not None


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.binary(max_size=64).filter(lambda b: b"\r" not in b and b"\n" not in b))
def test_any_header_bytes_give_a_key_or_a_401(state: GatewayState, raw: bytes) -> None:
    for value in (raw, b"Bearer " + raw, b"bearer  " + raw):
        try:
            key = state.auth.check_key(request(value))
        except APIError as exc:
            assert exc.status == 401
        else:
            assert key == "k1"
