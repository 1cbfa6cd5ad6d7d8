"""gateway/admission/admit.py alone: who gets a place, when, and what a refusal says; the request is
sent to the fake engine next door through the real EngineClient."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.admission.admit import Admitter
from gateway.admission.backlog import MARGIN, Work
from gateway.admission.queue import QueueFull, Served
from gateway.config import GatewayConfig
from gateway.engine.engine_client import EngineClient
from gateway.http.errors import APIError
from gateway.http.schemas import GenerateRequest
from gateway.prompt.intake import Draft, EngineRequest
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import codec
from protocol import messages as m
from tests.gateway.fake_engine import ROUTES, FakeEngine


class Setup:
    def __init__(self, info: m.TokenizerInfo, tok: GatewayTokenizer, **cfg: Any) -> None:
        self.client = EngineClient("inproc://unused")
        self.engine = FakeEngine(self.client, info, tok)
        self.rejections = Counter("rejections", "", ["reason"], registry=CollectorRegistry())
        self.admit = Admitter(GatewayConfig(**cfg), self.client, self.rejections)

    def costs(self, decode_s: float, prefill_row_s: float, share: float = 0.5) -> None:
        """The fake worker reports these measured step costs (as a heartbeat would)."""
        self.engine.worker.stats = m.Stats(step_costs=m.StepCosts(
            [(1.0, decode_s), (8.0, decode_s)], [(1, prefill_row_s)], share, 512))

    def request(self, seconds: float | None = 30.0, max_tokens: int = 4,
                prompt: int = 3) -> EngineRequest:
        now = time.monotonic()
        return EngineRequest("generate", None, now, None if seconds is None else now + seconds,
                             False, self.client.models["tiny"], [1] * prompt,
                             m.SamplingParams(max_tokens=max_tokens), [])

    def reserve(self, req: EngineRequest | None = None) -> Any:
        """admit.reserve for `req`'s draft (its body: the same prompt and max_tokens)."""
        req = req or self.request()
        body = GenerateRequest(prompt="x" * len(req.prompt_ids),
                               max_new_tokens=req.params.max_tokens)
        return self.admit.reserve(Draft(ROUTES[req.route], body, req.arrival, req.deadline, False,
                                        prompt_chars=len(req.prompt_ids)))

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
    assert setup.admit.limit("tiny") == 1
    other = Setup(smollm2_info, smollm2)
    assert other.admit.limit("tiny") == 8  # the fake worker's max_num_seqs
    other.client.link.close()


def test_each_model_has_its_own_seats_and_queue(smollm2_info: m.TokenizerInfo,
                                                smollm2: GatewayTokenizer) -> None:
    """Issue 42: the limit was the sum of every ready worker's max_num_seqs, whatever model it
    served: a worker of another model announcing 1,024 sequences let 12 requests at once onto a
    2-sequence worker (8 got 504). Seats, queue and backlog are now the model's own."""
    async def go() -> None:
        s = Setup(smollm2_info, smollm2, max_queue=2)
        big = m.Hello(m.PROTOCOL_VERSION, "big-worker", "big", 2048, 65536, 1024, smollm2_info)
        s.client.registry.admit(b"big", big, codec.tokenizer_digest(smollm2_info), smollm2)
        assert (s.admit.limit("tiny"), s.admit.limit("big")) == (8, 1024)
        tiny, other = s.admit.admission.of("tiny"), s.admit.admission.of("big")
        seated = [tiny.reserve(Work("tiny", 3, 4)) for _ in range(8)]
        assert all(t.granted for t in seated)
        queued = [tiny.reserve(Work("tiny", 3, 4)) for _ in range(2)]
        assert not any(t.granted for t in queued)  # big's 1,024 seats are not tiny's
        with pytest.raises(QueueFull):
            tiny.reserve(Work("tiny", 3, 4))
        assert other.reserve(Work("big", 3, 4)).granted  # nor is tiny's full queue big's
        s.admit.precheck()  # a body that may name "big" is still read
        assert (s.admit.admission.outstanding, s.admit.admission.waiting) == (9, 2)
        seated[0].slot.release()
        assert queued[0].granted or queued[0].future.done()  # tiny's own release wakes it
        s.client.link.close()

    asyncio.run(go())


def test_draining_is_a_503_before_and_after_the_body(setup: Setup) -> None:
    setup.admit.draining = True
    for call in (setup.admit.precheck, setup.reserve):
        with pytest.raises(APIError) as exc:
            call()
        assert (exc.value.status, exc.value.code) == (503, "shutting_down")
    assert setup.admit.admission.outstanding == 0


def test_a_full_queue_is_a_429_with_retry_after_at_once(setup: Setup) -> None:
    async def go() -> None:
        first = setup.reserve()
        second = setup.reserve()  # queued behind it
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


def test_seat_grants_the_slot_and_its_release_gives_it_back(setup: Setup) -> None:
    async def go() -> None:
        req = setup.request()
        ticket = setup.reserve(req)
        setup.admit.check_fit(req, ticket)  # nothing measured yet: it fits
        slot = await setup.admit.seat(req, ticket)
        assert setup.admit.admission.outstanding == 1 and not slot.released
        slot.release(Served("w"))
        assert setup.admit.admission.outstanding == 0
        assert len(setup.admit.admission.of("tiny").estimator._events["w"]) == 1

    asyncio.run(go())


def test_a_deadline_passed_in_the_queue_is_a_504_and_the_place_is_given_back(
        setup: Setup) -> None:
    async def go() -> None:
        holder = setup.reserve()
        req = setup.request(seconds=0.05)
        waiting = setup.reserve(req)
        with pytest.raises(APIError) as exc:
            await setup.admit.seat(req, waiting)
        assert (exc.value.status, exc.value.code) == (504, "timeout")
        assert waiting.cancelled and setup.admit.admission.waiting == 0
        holder.cancel()

    asyncio.run(go())


def test_a_model_no_ready_worker_serves_is_a_503_at_once(setup: Setup) -> None:
    async def go() -> None:
        setup.engine.worker.draining = True
        req = setup.request()
        ticket = setup.reserve(req)
        with pytest.raises(APIError) as exc:
            await setup.admit.seat(req, ticket)
        assert (exc.value.status, exc.value.code) == (503, "no_worker")
        assert setup.admit.admission.outstanding == 0 and not setup.engine.sent

    asyncio.run(go())


def test_check_fit_refuses_what_cannot_finish_in_time(setup: Setup) -> None:
    async def go() -> None:
        setup.costs(decode_s=0.5, prefill_row_s=0.001)  # 0.5 s a token
        req = setup.request(seconds=2.0, max_tokens=100)  # ~50 s even on an idle worker
        ticket = setup.reserve(setup.request(max_tokens=1))
        with pytest.raises(APIError) as exc:
            setup.admit.check_fit(req, ticket)
        assert (exc.value.status, exc.value.code) == (400, "deadline_unreachable")
        setup.admit.check_fit(setup.request(seconds=30.0, max_tokens=4), ticket)  # ~2 s: fits
        ticket.cancel()
        assert len(setup.admit.admission.of("tiny").backlog) == 0

    asyncio.run(go())


def test_a_request_without_a_deadline_waits_however_long_the_backlog(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    """No timeout asked and none set by the operator: never refused on an estimate, queued."""
    setup = Setup(smollm2_info, smollm2, max_outstanding=1, max_queue=4)

    async def go() -> None:
        setup.costs(decode_s=10.0, prefill_row_s=1.0)  # a very slow host
        holder = setup.reserve(setup.request(seconds=None, max_tokens=1000))
        req = setup.request(seconds=None, max_tokens=1000)
        waiting = setup.reserve(req)
        setup.admit.check_fit(req, waiting)  # no deadline: nothing to check
        assert holder.granted and not waiting.granted
        assert setup.rejected("would_miss_deadline") == 0
        waiting.cancel()
        holder.cancel()

    asyncio.run(go())
    setup.client.link.close()


def test_a_burst_is_admitted_only_as_far_as_it_can_finish_by_its_deadline(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    """Every request of a burst counts the ones reserved before it (not yet tokenized, not yet
    running): 8 seats at 0.1 s a step, 50 tokens a request: a round of 8 takes 5 s, times the
    margin; of 64 requests asking 30 s, the rounds that fit are admitted (3 at the margin of
    1.5) and the rest get 429 at once, before any runs."""
    setup = Setup(smollm2_info, smollm2, max_outstanding=0, max_queue=100)

    async def go() -> None:
        setup.costs(decode_s=0.1, prefill_row_s=0.001)
        tickets, refused = [], 0
        for _ in range(64):
            try:
                tickets.append(setup.reserve(setup.request(seconds=30.0, max_tokens=50)))
            except APIError as exc:
                assert (exc.status, exc.code) == (429, "would_miss_deadline")
                assert int(exc.headers["Retry-After"]) >= 1
                refused += 1
        rounds = math.floor(29.5 / (5.0 * MARGIN))  # a little of 30 s goes to the prompts
        assert len(tickets) == 8 * rounds and refused == 64 - 8 * rounds
        assert setup.rejected("would_miss_deadline") == refused
        for t in tickets:
            t.cancel()
        assert len(setup.admit.admission.of("tiny").backlog) == 0  # nothing counted is left behind

    asyncio.run(go())
    setup.client.link.close()
