"""gateway/api/exchange.py: one request's lifecycle, closed in one place. The real Starlette app
in-process (httpx's ASGITransport) against the fake engine next door; what each exit leaves
behind is read from the gateway's own state: the admission queue, the drain estimator's events,
the request counter."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from gateway.api.app import create_app
from gateway.config import GatewayConfig
from gateway.engine.on_demand import Claim, OnDemand
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import messages as m
from tests.gateway.fake_engine import FakeEngine

CHAT = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}


def counted(app: Any) -> dict[tuple[str, str, str], float]:
    """The request counter's samples: (route, status, finish) -> count."""
    [family] = [f for f in app.state.gateway.metrics.requests.collect()]
    return {(s.labels["route"], s.labels["status"], s.labels["finish_reason"]): s.value
            for s in family.samples if s.name.endswith("_total") and s.value}


def serve(info: m.TokenizerInfo, tok: GatewayTokenizer, *calls: tuple[str, dict[str, Any]],
          stream_lines: bool = False) -> tuple[Any, FakeEngine, list[httpx.Response]]:
    app = create_app(GatewayConfig())
    engine = FakeEngine(app.state.gateway.client, info, tok)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return [await http.post(path, json=body) for path, body in calls]

    return app, engine, asyncio.run(run())


def test_an_answered_request_sends_the_time_left_and_leaves_nothing_held(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    app, engine, [resp] = serve(smollm2_info, smollm2,
                                ("/v1/chat/completions", {**CHAT, "timeout": 30}))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    [sent] = [msg for msg in engine.sent if isinstance(msg, m.Generate)]
    assert 29 < sent.timeout_s <= 30  # the time left, never a wall-clock instant
    admission = app.state.gateway.admission
    assert admission.outstanding == 0 and admission.waiting == 0
    # its slot went back with the Served event: the worker that ran it taught the drain rate
    assert len(admission.of("tiny").estimator._events["fake-worker"]) == 1
    assert counted(app) == {("chat", "200", "length"): 1}  # recorded once


def test_a_stream_is_closed_once_by_its_own_end(smollm2_info: m.TokenizerInfo,
                                                 smollm2: GatewayTokenizer) -> None:
    app, _, [resp] = serve(smollm2_info, smollm2,
                           ("/v1/chat/completions", {**CHAT, "stream": True}))
    assert resp.status_code == 200
    assert resp.text.rstrip().endswith("data: [DONE]")
    admission = app.state.gateway.admission
    assert admission.outstanding == 0 and admission.waiting == 0
    assert len(admission.of("tiny").estimator._events["fake-worker"]) == 1
    assert counted(app) == {("chat", "200", "length"): 1}


def test_refusals_are_recorded_once_and_hold_nothing(smollm2_info: m.TokenizerInfo,
                                                     smollm2: GatewayTokenizer) -> None:
    app, engine, resps = serve(
        smollm2_info, smollm2,
        ("/v1/chat/completions", {**CHAT, "max_tokens": "3"}),  # 422: not an integer
        ("/v1/chat/completions", {**CHAT, "model": "nobody"}),  # 404: no such model
        ("/v1/completions", {"model": "tiny", "prompt": [10**9]}))  # 400: outside the vocabulary
    assert [r.status_code for r in resps] == [422, 404, 400], [r.text for r in resps]
    assert all(r.json()["error"]["message"] and r.headers["X-Request-ID"] for r in resps)
    assert not [msg for msg in engine.sent if isinstance(msg, m.Generate)]
    admission = app.state.gateway.admission
    assert admission.outstanding == 0 and admission.waiting == 0
    assert counted(app) == {("chat", "422", "error"): 1, ("chat", "404", "error"): 1,
                            ("completions", "400", "error"): 1}


class Launched:
    """--models-dir's launcher for two models; "tiny" started with the server (its worker is
    the fake engine), "other" never joins."""

    def __init__(self) -> None:
        self.catalog = {"tiny": "/m/tiny.gguf", "other": "/m/other.gguf"}
        self.alive, self.stopped = {"tiny"}, []

    def start(self, model_id: str) -> None:
        self.alive.add(model_id)

    def stop(self, model_id: str) -> None:
        self.stopped.append(model_id)

    def running(self, model_id: str) -> bool:
        return model_id in self.alive

    def failure(self, model_id: str) -> str | None:
        return None


def test_a_model_granted_to_a_request_is_not_unloaded_before_its_reservation(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    """Issue 58's starvation gap: the wait for the model ends a loop turn before the route
    resumes; another model's request in that turn (--models-max 1) once unloaded it."""
    app = create_app(GatewayConfig())
    FakeEngine(app.state.gateway.client, smollm2_info, smollm2)
    state, launcher = app.state.gateway, Launched()
    pool = state.models_on_demand = OnDemand(launcher, state.client.registry, state._busy,
                                             models_max=1, metrics=CollectorRegistry())
    claim, others = pool.claim, []

    def with_a_rival(name: str | None, deadline: float | None) -> Claim:
        mine = claim(name, deadline)
        if name == "tiny":  # the rival arrives in the turn between the grant and the route
            asyncio.get_running_loop().call_soon(lambda: others.append(claim("other", None)))
        return mine

    pool.claim = with_a_rival  # type: ignore[method-assign]
    stopped_at_reservation: list[list[str]] = []
    reserve = state.admit.reserve

    def watched(draft: Any) -> Any:
        stopped_at_reservation.append(list(launcher.stopped))
        return reserve(draft)

    state.admit.reserve = watched

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return await http.post("/v1/chat/completions", json=CHAT)

    resp = asyncio.run(run())
    assert resp.status_code == 200, resp.text
    assert len(others) == 1 and stopped_at_reservation == [[]]  # tiny was up for its place


def test_one_admission_sequence_reserves_for_every_way_in() -> None:
    """Issue 55: a request's place in the queue is reserved in one place, Exchange._admitted,
    whether it came in directly or waited for its model to load; no other gateway code calls
    admit.reserve."""
    import re
    from pathlib import Path

    gateway = Path(__file__).resolve().parents[3] / "gateway"
    calls = [(p.relative_to(gateway.parent), n) for p in sorted(gateway.rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\badmit\.reserve\(", line)]
    assert len(calls) == 1 and calls[0][0].as_posix() == "gateway/api/exchange.py", calls
