"""What the gateway writes down about each request: metrics, one log line, one trace span.

    admitted ──opened(gen)──▶ the span opens (its context reaches the worker in the Generate)
    any exit (answered, rejected, refused, aborted, timed out, its worker lost)
        ──record()──▶ request counter, latency and length histograms, token counters, the
                      workers' measured rates (a request that ran its course), the log line,
                      the span's end

The gauges read live state at scrape time (`watch`): admission's queue and the ready workers.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from gateway.admission.queue import Admissions
from gateway.engine.engine_client import EngineClient
from gateway.output.generation import Generation
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import RequestTracer

log = logging.getLogger("kestrel.gateway.requests")
# The finish reason an error status implies, whatever the choices said before it.
_STATUS_FINISH = {429: "rejected", 499: "aborted", 504: "timeout"}


class Accounting:
    def __init__(self, metrics: Metrics, tracer: RequestTracer | None) -> None:
        self.metrics = metrics
        self.tracer = tracer  # None: tracing off

    def watch(self, admission: Admissions, client: EngineClient) -> None:
        """Point the gauges at what they show; they are read at each scrape."""
        mx = self.metrics
        mx.in_flight.set_function(lambda: admission.outstanding)
        mx.waiting.set_function(lambda: admission.waiting)
        mx.workers_ready.set_function(lambda: len(client.ready_workers()))
        mx.drain_rate.set_function(admission.drain_rate)
        mx.service_time.set_function(admission.service_s)
        mx.expected_wait.set_function(
            lambda: math.nan if (w := admission.expected_wait()) is None else w)

    def opened(self, gen: Generation) -> None:
        """Admitted: the span opens now, so that its context reaches the worker."""
        if self.tracer is not None:
            self.tracer.start(gen)

    def record(self, route: str, status: int, gen: Generation | None, arrival: float,
               request_id: str, finish: str | None = None) -> None:
        """One request ended, by any exit: count it, observe its timings, write one structured
        log line. `finish` is the route's word (aborted, timeout) where the choices' own
        reasons do not say it."""
        now = time.monotonic()
        fields: dict[str, Any] = {
            "event": "request_end", "request_id": request_id, "route": route, "status": status,
            "tokens_in": None, "tokens_out": None, "queue_wait_ms": None,
            "gateway_wait_ms": None, "ttft_ms": None, "tpot_ms": None,
            "total_ms": _ms(now - arrival), "worker": None, "engine_request_id": None}
        reasons: list[str | None] = []
        if gen is not None:  # it was admitted: it may have reached a worker
            reasons = self._observe(gen, arrival, now, fields)
        finish = finish or _finish_reason(status, reasons)
        fields["finish_reason"] = finish
        self.metrics.requests.labels(route, str(status), finish).inc()
        log.info("request ended", extra={"fields": fields})
        if self.tracer is not None:
            self.tracer.end(route, status, gen, arrival, request_id, finish)

    def _observe(self, gen: Generation, arrival: float, now: float,
                 fields: dict[str, Any]) -> list[str | None]:
        """The histograms and counters of an admitted request, and its fields for the log line;
        its choices' finish reasons."""
        mx, t = self.metrics, gen.timings
        prompt_tokens, completion_tokens = gen.prompt_tokens, gen.completion_tokens
        reasons = gen.finish_reasons
        worker = gen.handle.worker.name if gen.handle else None
        queue_wait, tpot = t.queue_wait, t.tpot()
        mx.e2e.observe(now - arrival)
        mx.prompt_tokens.inc(prompt_tokens)
        mx.generation_tokens.inc(completion_tokens)
        mx.prompt_len.observe(prompt_tokens)
        mx.gen_len.observe(completion_tokens)
        for gap in t.gaps:
            mx.itl.observe(gap)
        ttft = None if t.first_token is None else t.first_token - arrival
        for histogram, value in ((mx.queue_wait, queue_wait), (mx.ttft, ttft), (mx.tpot, tpot)):
            if value is not None:
                histogram.observe(value)
        fields.update({
            "tokens_in": prompt_tokens, "tokens_out": completion_tokens,
            "queue_wait_ms": _ms(queue_wait), "ttft_ms": _ms(ttft), "tpot_ms": _ms(tpot),
            # the part of the queue wait spent in the gateway's own admission queue
            "gateway_wait_ms": None if t.sent is None else _ms(t.sent - arrival),
            "engine_request_id": gen.request_id,
            "worker": worker})
        return reasons


def _finish_reason(status: int, choices: list[str | None]) -> str:
    """The finish reason of the log line and the counter, from the status and the choices'."""
    if status in _STATUS_FINISH:
        return _STATUS_FINISH[status]
    if status >= 400:
        return "error"
    reasons = [r for r in choices if r]
    reason = reasons[0] if reasons else "none"
    return "aborted" if reason == "abort" else reason  # the worker's word for it


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
