"""loadgen/client.py and loadgen/runner.py against an in-process fake OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import time

import pytest

from loadgen.config import LengthDist, LoadConfig, WorkloadConfig
from loadgen.runner import RunResult, run_load
from tests.loadgen.fake_openai import EARLY_STOP, FakeOpenAI


def config(server: FakeOpenAI, **kw: object) -> LoadConfig:
    defaults: dict[str, object] = dict(
        base_url=server.base_url, mode="closed", concurrency=2, num_requests=6,
        workload=WorkloadConfig(LengthDist.fixed(12), LengthDist.uniform(2, 8)), timeout_s=30)
    defaults.update(kw)
    return LoadConfig(**defaults)  # type: ignore[arg-type]


def run(cfg: LoadConfig) -> RunResult:
    return asyncio.run(run_load(cfg))


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_records_have_chunks_and_usage(api: str) -> None:
    with FakeOpenAI(split_writes=True) as server:
        result = run(config(server, api=api, api_key="sk-test", seed=5))
    assert result.model == "fake-model"  # from GET /models
    assert len(result.records) == 6 and [r.index for r in result.records] == list(range(6))
    assert {b["model"] for b in server.bodies} == {"fake-model"}
    assert set(server.auth) == {"Bearer sk-test"}
    for r in result.records:
        assert r.ok and r.done and r.status == 200, r.error
        assert r.n_chunks == r.target_output_len == r.completion_tokens
        assert r.prompt_tokens == 12 and r.finish_reason == "length"
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s  # type: ignore[operator]
        assert len(r.itl_s) == r.n_chunks - 1
        # Chunks that arrive in one network read share a timestamp: a gap may be 0, and
        # the mean gap after the first token is the mean of the gaps.
        if r.n_chunks >= 2:
            assert r.tpot_s == pytest.approx(sum(r.itl_s) / len(r.itl_s)) and r.tpot_s >= 0
        else:
            assert r.tpot_s is None
    s = result.summary
    assert s.completed == 6 and s.rejected == 0 and s.errors == 0
    assert s.completion_tokens == sum(b["max_tokens"] for b in server.bodies)
    assert s.prompt_tokens == 6 * 12


def test_429_is_a_rejection_and_error_events_are_errors() -> None:
    with FakeOpenAI(reject_every=3, error_every=4) as server:
        result = run(config(server, num_requests=12, concurrency=3, model="given-model"))
    # Requests 2, 5, 8, 11 are refused; of the 8 streamed, those numbered 3 and 7 by the server
    # fail with an error event mid-stream.
    s = result.summary
    assert (s.num_requests, s.rejected, s.errors, s.completed) == (12, 4, 2, 6)
    assert s.rejection_rate == pytest.approx(4 / 12) and s.error_rate == pytest.approx(2 / 12)
    rejected = [r for r in result.records if r.rejected]
    assert all(r.status == 429 and "queue full" in (r.error or "") for r in rejected)
    failed = [r for r in result.records if r.failed]
    assert all(r.status == 200 and r.error == "worker lost" for r in failed)
    assert {b["model"] for b in server.bodies} == {"given-model"}  # no GET /models needed


def test_no_ignore_eos_is_not_sent() -> None:
    with FakeOpenAI() as server:
        result = run(config(server, ignore_eos=False, num_requests=3, concurrency=1,
                            workload=WorkloadConfig(output_len=LengthDist.fixed(10))))
    assert all("ignore_eos" not in b for b in server.bodies)
    assert [r.completion_tokens for r in result.records] == [EARLY_STOP] * 3


def test_closed_loop_holds_concurrency() -> None:
    with FakeOpenAI(first_delay_s=0.05) as server:
        result = run(config(server, concurrency=4, num_requests=12))
    assert server.max_in_flight == 4  # never more, and the workers do overlap
    assert result.summary.completed == 12 and result.summary.concurrency == 4


def test_closed_loop_for_a_duration() -> None:
    with FakeOpenAI(first_delay_s=0.03) as server:
        result = run(config(server, concurrency=2, num_requests=None, duration_s=0.3))
    assert 4 <= len(result.records) <= 30
    assert all(r.ok for r in result.records)
    assert max(r.sent_s for r in result.records) < 0.3


def test_open_loop_sends_on_schedule_while_the_server_is_saturated() -> None:
    # Each response takes 1 s to begin while requests arrive at 40/s: ~40 are in flight at once.
    # An open loop must still send every request on schedule: a sender that waited for an
    # answer would be 1 s late; the bound (a quarter of that) leaves room for a loaded host.
    with FakeOpenAI(first_delay_s=1.0) as server:
        t0 = time.perf_counter()
        result = run(config(server, mode="open", rate=40.0, num_requests=40, seed=1,
                            workload=WorkloadConfig(LengthDist.fixed(4), LengthDist.fixed(2))))
        elapsed = time.perf_counter() - t0
    lags = [r.send_lag_s for r in result.records]
    assert max(lags) < 0.25, max(lags)
    assert min(lags) >= 0
    assert server.max_in_flight > 20  # the server really was holding many requests
    assert result.summary.max_send_lag_ms < 250
    assert result.summary.completed == 40 and result.summary.offered_rate == 40.0
    last_scheduled = max(r.scheduled_s for r in result.records)
    assert elapsed < last_scheduled + 3.0  # ~1 s of response after the last send
    # Arrival gaps as the server saw them follow the schedule, not the responses.
    arrivals = sorted(server.arrivals)
    assert arrivals[-1] - arrivals[0] == pytest.approx(
        last_scheduled - min(r.scheduled_s for r in result.records), abs=0.1)


def test_open_loop_schedule_is_reproducible() -> None:
    with FakeOpenAI() as server:
        a = run(config(server, mode="open", rate=200.0, num_requests=10, seed=3))
        b = run(config(server, mode="open", rate=200.0, num_requests=10, seed=3))
    assert [r.scheduled_s for r in a.records] == [r.scheduled_s for r in b.records]
    prompts = [b["prompt"] for b in server.bodies]
    assert sorted(prompts[:10]) == sorted(prompts[10:])


def test_unreachable_server_is_an_error_per_request() -> None:
    with FakeOpenAI() as server:
        url = server.base_url
    result = run(LoadConfig(base_url=url, model="m", mode="closed", num_requests=2, timeout_s=5))
    assert result.summary.errors == 2 and all(r.status == 0 for r in result.records)


def test_no_keepalive_opens_a_connection_per_request() -> None:
    with FakeOpenAI() as server:
        result = run(config(server, concurrency=1, num_requests=5, keepalive=False))
    assert result.summary.completed == 5
    assert len(set(server.peers)) == 5  # each request from a new client port
