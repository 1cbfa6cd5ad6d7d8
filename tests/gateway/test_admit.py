"""gateway/admit.py alone: who gets a place, when, and what a refusal says; the request is sent
to the fake engine next door through the real EngineClient."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.accounting import Accounting
from gateway.admit import Admitter
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.errors import APIError
from gateway.intake import EngineRequest
from gateway.metrics import Metrics
from gateway.service_time import ServiceTimes
from gateway.tokenizer import GatewayTokenizer
from protocol import messages as m
from tests.gateway.fake_engine import FakeEngine


class Setup:
    def __init__(self, info: m.TokenizerInfo, tok: GatewayTokenizer, **cfg: Any) -> None:
        self.client = EngineClient("inproc://unused")
        self.engine = FakeEngine(self.client, info, tok)
        self.times = ServiceTimes()
        metrics = Metrics(lambda: [])
        self.rejections = Counter("rejections", "", ["reason"], registry=CollectorRegistry())
        self.admit = Admitter(GatewayConfig(**cfg), self.client, self.times,
                              Accounting(metrics, self.times, None), self.rejections)

    def request(self, seconds: float = 30.0, max_tokens: int = 4) -> EngineRequest:
        now = time.monotonic()
        return EngineRequest("generate", None, now, now + seconds, False,
                             self.client.models["tiny"], [1, 2, 3],
                             m.SamplingParams(max_tokens=max_tokens), [])

    def rejected(self, reason: str) -> float:
        return self.rejections.labels(reason)._value.get()


@pytest.fixture
def setup(smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> Any:
    s = Setup(smollm2_info, smollm2, max_outstanding=1, max_queue=1)
    yield s
    s.client.link.close()


def test_the_limit_is_the_setting_or_the_workers_capacity(setup: Setup,
                                                          smollm2_info: m.TokenizerInfo,
                                                          smollm2: GatewayTokenizer) -> None:
    assert setup.admit.limit() == 1
    other = Setup(smollm2_info, smollm2)
    assert other.admit.limit() == 8  # the fake worker's max_num_seqs
    other.client.link.close()


def test_draining_is_a_503_before_and_after_the_body(setup: Setup) -> None:
    setup.admit.draining = True
    for call in (setup.admit.precheck, lambda: setup.admit.reserve(time.monotonic() + 5)):
        with pytest.raises(APIError) as exc:
            call()
        assert (exc.value.status, exc.value.code) == (503, "shutting_down")
    assert setup.admit.admission.outstanding == 0


def test_a_full_queue_is_a_429_with_retry_after_at_once(setup: Setup) -> None:
    async def go() -> None:
        first = setup.admit.reserve(time.monotonic() + 30)
        second = setup.admit.reserve(time.monotonic() + 30)  # queued behind it
        assert first.granted and not second.granted
        with pytest.raises(APIError) as exc:
            setup.admit.precheck()
        err = exc.value
        assert (err.status, err.code) == (429, "queue_full")
        assert int(err.headers["Retry-After"]) >= 1 and int(err.headers["retry-after-ms"]) >= 1
        assert setup.rejected("queue_full") == 1
        second.cancel()
        first.cancel()
        assert setup.admit.admission.outstanding == 0

    asyncio.run(go())


def test_start_sends_the_request_and_close_gives_the_slot_back(setup: Setup) -> None:
    async def go() -> None:
        req = setup.request()
        ticket = setup.admit.reserve(req.deadline)
        setup.admit.check_fit(req, ticket)  # nothing measured yet: it fits
        gen = await setup.admit.start(req, ticket)
        [sent] = [msg for msg in setup.engine.sent if isinstance(msg, m.Generate)]
        assert sent.prompt_token_ids == [1, 2, 3] and sent.params.max_tokens == 4
        assert 29 < sent.timeout_s <= 30  # the time left, never a wall-clock instant
        assert setup.admit.admission.outstanding == 1
        events = [e async for e in gen.events()]
        assert events[-1].finish_reason == "length"
        assert setup.admit.admission.outstanding == 0  # events() closed it

    asyncio.run(go())


def test_a_deadline_passed_in_the_queue_is_a_504_and_the_place_is_given_back(
        setup: Setup) -> None:
    async def go() -> None:
        holder = setup.admit.reserve(time.monotonic() + 30)
        req = setup.request(seconds=0.05)
        waiting = setup.admit.reserve(req.deadline)
        with pytest.raises(APIError) as exc:
            await setup.admit.start(req, waiting)
        assert (exc.value.status, exc.value.code) == (504, "timeout")
        assert waiting.cancelled and setup.admit.admission.waiting == 0
        holder.cancel()

    asyncio.run(go())


def test_a_model_no_ready_worker_serves_is_a_503_at_once(setup: Setup) -> None:
    async def go() -> None:
        setup.engine.worker.draining = True
        req = setup.request()
        ticket = setup.admit.reserve(req.deadline)
        with pytest.raises(APIError) as exc:
            await setup.admit.start(req, ticket)
        assert (exc.value.status, exc.value.code) == (503, "no_worker")
        assert setup.admit.admission.outstanding == 0 and not setup.engine.sent

    asyncio.run(go())


def test_check_fit_refuses_what_cannot_finish_in_time(setup: Setup) -> None:
    async def go() -> None:
        setup.times.observe("fake-worker", 1, 3, 0.01, 0.5)  # 0.5 s a token
        req = setup.request(seconds=2.0, max_tokens=100)  # ~50 s even on an idle worker
        ticket = setup.admit.reserve(req.deadline)
        with pytest.raises(APIError) as exc:
            setup.admit.check_fit(req, ticket)
        assert (exc.value.status, exc.value.code) == (400, "deadline_unreachable")
        setup.admit.check_fit(setup.request(seconds=30.0, max_tokens=4), ticket)  # ~2 s: fits
        ticket.cancel()

    asyncio.run(go())
