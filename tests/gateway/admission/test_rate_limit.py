"""gateway/admission/rate_limit.py with a fake clock, and the 429 the gateway builds from it."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from gateway.admission.rate_limit import RateLimiter
from gateway.config import GatewayConfig
from gateway.http.errors import APIError
from gateway.service import GatewayState


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limiter(rate: float, burst: int, **kw: int) -> tuple[RateLimiter, FakeClock]:
    clock = FakeClock()
    return RateLimiter(rate, burst, clock=clock, **kw), clock


def test_off_when_the_rate_is_zero() -> None:
    lim, _ = limiter(0, 1)
    assert not lim.enabled
    assert all(lim.take("c") == 0.0 for _ in range(1000))


def test_a_burst_passes_then_the_wait_is_the_time_to_the_next_token() -> None:
    lim, clock = limiter(2.0, 3)
    assert [lim.take("c") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert lim.take("c") == pytest.approx(0.5)
    clock.now += 0.2  # 0.4 of a token back
    assert lim.take("c") == pytest.approx(0.3)
    clock.now += 0.3
    assert lim.take("c") == 0.0
    assert lim.take("c") == pytest.approx(0.5)


def test_refused_requests_do_not_spend_tokens() -> None:
    lim, clock = limiter(1.0, 1)
    assert lim.take("c") == 0.0
    for _ in range(10):
        assert lim.take("c") == pytest.approx(1.0)
    clock.now += 1.0
    assert lim.take("c") == 0.0


def test_refill_stops_at_the_burst() -> None:
    lim, clock = limiter(10.0, 2)
    lim.take("c")
    clock.now += 3600
    assert [lim.take("c") > 0 for _ in range(3)] == [False, False, True]


def test_each_client_has_its_own_bucket() -> None:
    lim, _ = limiter(1.0, 1)
    assert lim.take("a") == 0.0
    assert lim.take("a") > 0
    assert lim.take("b") == 0.0


def test_memory_is_bounded_by_forgetting_full_buckets() -> None:
    lim, clock = limiter(1.0, 1, max_clients=3)
    for c in "abc":
        lim.take(c)
    clock.now += 10  # every bucket is full again: forgetting them changes nothing
    lim.take("d")
    assert lim.take("d") > 0
    assert lim.take("a") == 0.0  # a fresh bucket, as it would have been


def test_idle_clients_are_forgotten_once_their_buckets_refill() -> None:
    # 5,000 clients once each: their buckets refill in burst/rate = 2 s, and the next request
    # (from anyone) finds them gone. Before the fix, stored buckets were tested for "full"
    # without the refill, so all 5,000 stayed for ever.
    lim, clock = limiter(5.0, 10)
    for i in range(5000):
        lim.take(f"10.0.{i // 256}.{i % 256}")
    assert len(lim) == 5000
    clock.now += 2.0
    lim.take("someone-else")
    assert len(lim) == 1


def test_a_client_still_refilling_is_kept() -> None:
    lim, clock = limiter(1.0, 2)
    lim.take("a")
    lim.take("a")  # empty: 2 s to full
    clock.now += 1.0
    lim.take("b")
    assert len(lim) == 2
    assert lim.take("a") == 0.0 and lim.take("a") > 0  # its 1 refilled token, then none


def test_beyond_max_clients_the_least_recently_used_go_first() -> None:
    lim, clock = limiter(0.001, 1, max_clients=100)
    for i in range(1000):
        lim.take(str(i))
        clock.now += 0.001
    assert len(lim) == 100


def request(key: str | None = None, host: str = "10.0.0.1") -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": headers, "client": (host, 1234)})


def state(**cfg: object) -> tuple[GatewayState, FakeClock]:
    st = GatewayState(GatewayConfig(**cfg))  # type: ignore[arg-type]
    clock = FakeClock()
    st.auth.limiter = RateLimiter(st.cfg.rate_limit_rps, st.cfg.rate_limit_burst, clock=clock)
    return st, clock


def test_the_429_carries_retry_after_from_the_bucket() -> None:
    st, clock = state(rate_limit_rps=0.4, rate_limit_burst=1)
    st.auth.guard(request())
    with pytest.raises(APIError) as exc:
        st.auth.guard(request())
    err = exc.value
    assert err.status == 429 and err.code == "rate_limited"
    assert err.headers == {"Retry-After": "3", "retry-after-ms": "2500"}  # 1 token / 0.4 per s
    clock.now += 2.0
    with pytest.raises(APIError) as exc:
        st.auth.guard(request())
    assert exc.value.headers == {"Retry-After": "1", "retry-after-ms": "500"}
    st.auth.guard(request(host="10.0.0.2"))  # keys off: the client is its address


def test_with_keys_the_client_is_its_key_not_its_address() -> None:
    st, _ = state(rate_limit_rps=1.0, rate_limit_burst=1, api_keys="k1,k2")
    st.auth.guard(request("k1"))
    with pytest.raises(APIError) as exc:
        st.auth.guard(request("k1", host="10.9.9.9"))
    assert exc.value.status == 429
    st.auth.guard(request("k2"))
    with pytest.raises(APIError) as exc:
        st.auth.guard(request("nope"))
    assert exc.value.status == 401
