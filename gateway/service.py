"""What every generation route does before and after its own formatting.

    guard (keys, rate limit, draining) -> precheck (429 before the body is read) -> read_json
    (413/400/408) -> parse (422) -> reserve (429 at once: queue full or deadline out of reach)
    -> resolve model -> tokenize in a thread -> context check (400) -> start: wait for the slot
    (504) -> Generation.start() (503 without a worker) ... route formats ... -> record()
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.admission import Admission, QueueClosed, Rejected, Ticket, WouldMissDeadline
from gateway.body import read_json
from gateway.config import GatewayConfig
from gateway.drain import DrainEstimator
from gateway.engine_client import EngineClient, ModelEntry, NoWorkerError, new_request_id
from gateway.errors import APIError, validation_error
from gateway.generation import Generation
from gateway.metrics import Metrics
from gateway.rate_limit import RateLimiter
from gateway.service_time import DoesNotFit, ServiceTimes, check_fit
from gateway.tracing import RequestTracer
from protocol import messages as m

log = logging.getLogger("kestrel.gateway.requests")
M = TypeVar("M", bound=BaseModel)
# The finish reason an error status implies, whatever the choices said before it.
_STATUS_FINISH = {429: "rejected", 499: "aborted", 504: "timeout"}
@dataclass
class Prepared:
    model: ModelEntry
    prompt_ids: list[int]
    params: m.SamplingParams
    stop: list[str]
    deadline: float
    arrival: float
    grammar: str | None = None  # structured output (gateway/structured.py)
    cache_salt: str = ""  # the prefix cache's tenant (gateway/tenancy.py)


class GatewayState:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.keys = cfg.keys()
        # A configured key is text (a file is UTF-8); a header is latin-1-decoded bytes: both
        # become the bytes that would cross the wire, so a UTF-8 key still matches.
        self._key_bytes = [k.encode("utf-8") for k in self.keys]
        self.client = EngineClient.from_config(cfg)
        self.admission = Admission(
            self._limit, cfg.max_queue, DrainEstimator(),
            workers=lambda: [w.hello.worker_id for w in self.client.ready_workers()],
            cold_queue=self._limit)
        self.service_times = ServiceTimes()  # each worker's measured prefill and token rates
        self.metrics = Metrics(lambda: list(self.client.workers.values()))
        self.limiter = RateLimiter(cfg.rate_limit_rps, cfg.rate_limit_burst)
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the app's lifespan
        self.tracer = RequestTracer.create(cfg.otlp_endpoint)  # None: tracing off
        self.client.on_stats.append(lambda _w, _s: self.admission.poke())
        self.metrics.in_flight.set_function(lambda: self.admission.outstanding)
        self.metrics.waiting.set_function(lambda: self.admission.waiting)
        self.metrics.workers_ready.set_function(lambda: len(self.client.ready_workers()))
        self.metrics.drain_rate.set_function(self.admission.drain_rate)
        self.metrics.service_time.set_function(self.admission.estimator.service_s)
        self.metrics.expected_wait.set_function(
            lambda: math.nan if (w := self.admission.expected_wait()) is None else w)

    def _limit(self) -> int:
        return self.cfg.max_outstanding or self.client.capacity()

    @property
    def ready(self) -> bool:
        return self.client.ready and not self.draining and not self.admission.queue_full

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work at once (this may run in a signal handler, so the rest is
        handed to the loop): fail the queued requests, and when drain_timeout_s has passed,
        end what still runs with a 503 in its own shape (a stream's error event, then [DONE])."""
        if self.draining:  # a second signal: the drain is already under way
            return
        self.draining = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self.admission.reject_waiters()
        asyncio.get_running_loop().call_later(
            self.cfg.drain_timeout_s, self.client.fail_all,
            "the server is shutting down and its drain timeout has passed")

    # ---- before ------------------------------------------------------------------------------

    def check_key(self, request: Request) -> str | None:
        """The caller's key, or None when keys are off; 401 when keys are on and it is wrong."""
        if not self.keys:
            return None
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        # Compared as bytes: hmac.compare_digest refuses a non-ASCII str (TypeError, a 500),
        # and a header is whatever bytes the client sent (Starlette decodes them as latin-1).
        given = key.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not any(
                hmac.compare_digest(given, k) for k in self._key_bytes):
            raise APIError(401, "a valid API key is required: Authorization: Bearer <key>",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return key.strip()

    def guard(self, request: Request) -> str | None:
        """Keys, draining, the rate limit; returns the caller's key (None: keys are off)."""
        key = self.check_key(request)
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        client = key or (request.client.host if request.client else "unknown")
        wait = self.limiter.take(client)
        if wait > 0:
            self.metrics.rejections.labels("rate_limit").inc()
            # Retry-After is whole seconds (HTTP); retry-after-ms, which OpenAI's clients read
            # first, carries the bucket's exact refill time.
            raise APIError(429, "rate limit exceeded for this client", code="rate_limited",
                           headers={"Retry-After": str(max(1, math.ceil(wait))),
                                    "retry-after-ms": str(max(1, math.ceil(wait * 1000)))})
        return key

    async def read_json(self, request: Request) -> Any:
        return await read_json(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s)

    def parse(self, cls: type[M], data: Any) -> M:
        if not isinstance(data, dict):
            raise APIError(422, "the body must be a JSON object", code="invalid_value")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def resolve_model(self, name: str | None) -> ModelEntry:
        if not self.client.models:
            raise APIError(503, "no worker is ready yet", code="no_worker")
        if name is None or name == "":
            return next(iter(self.client.models.values()))
        entry = self.client.model(name)
        if entry is None:
            served = ", ".join(self.client.models)
            raise APIError(404, f"model {name!r} is not served here (served: {served})",
                           param="model", code="model_not_found")
        return entry

    async def tokenize(self, func: Any, *args: Any) -> list[int]:
        # Tokenizing a long prompt is CPU work: keep it off the event loop.
        return await asyncio.to_thread(func, *args)

    def _load(self, model_id: str) -> list[tuple[str, int]]:
        """(worker id, sequences it runs for us now) for the ready workers of the model: our
        own count (each request's n), not the heartbeat's, which may be a second old."""
        reqs = self.client.requests
        return [(w.hello.worker_id, sum(reqs[r].gen.params.n for r in w.inflight if r in reqs))
                for w in self.client.registry.candidates(model_id)]

    def make_params(self, model: ModelEntry, prompt_len: int, max_tokens: int | None,
                    default_max: int, deadline: float, **fields: Any) -> m.SamplingParams:
        """An absent max_tokens is the route's default, within the cap and the context, and
        within what the model's fastest worker was measured to finish before `deadline` at its
        current load: a plain request ends with "length", never in a 504 nor refused for a
        default it did not choose."""
        room = model.hello.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = min(default_max, self.cfg.max_tokens_cap, room)
            fits = self.service_times.tokens_within(
                self._load(model.model_id), prompt_len, deadline - time.monotonic(),
                fields.get("n", 1))
            if fits is not None:
                max_tokens = max(1, min(max_tokens, fits))
            if room < 1:
                raise APIError(400, f"the prompt has {prompt_len} tokens, which leaves no room "
                               f"in the context of {model.hello.max_model_len}",
                               param="prompt", code="context_length_exceeded")
        elif prompt_len + max_tokens > model.hello.max_model_len:
            raise APIError(400, f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens})"
                           f" exceeds the model's context of {model.hello.max_model_len}",
                           param="max_tokens", code="context_length_exceeded")
        top_k = fields.pop("top_k", -1)
        return m.SamplingParams(max_tokens=max_tokens, top_k=max(0, top_k), **fields)

    def check_fit(self, prep: Prepared, ticket: Ticket) -> None:
        """After tokenizing: 400 if this request could not finish before its deadline even on
        an idle worker, 429 if not at the current load (gateway/service_time.py)."""
        now = time.monotonic()
        wait = 0.0 if ticket.granted else (self.admission.expected_wait() or 0.0)
        try:
            check_fit(self.service_times, self._load(prep.model.model_id), len(prep.prompt_ids),
                      prep.params.max_tokens, prep.params.n, prep.deadline - prep.arrival,
                      prep.deadline - now, wait)
        except DoesNotFit as exc:
            if exc.idle:
                raise APIError(400, str(exc), param=exc.param,
                               code="deadline_unreachable") from None
            raise self._rejected(WouldMissDeadline(str(exc), exc.retry_after)) from None

    def deadline(self, arrival: float, timeout: float | None) -> float:
        seconds = self.cfg.default_timeout_s if timeout is None else min(
            timeout, self.cfg.default_timeout_s)
        return arrival + seconds

    def precheck(self) -> None:
        """Before the body is read: 429 at once if even the longest deadline would not get a
        place, so a refused request costs no body read, no tokenizing and no thread."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            self.admission.check(self.cfg.default_timeout_s)
        except Rejected as exc:
            raise self._rejected(exc) from None

    def reserve(self, deadline: float) -> Ticket:
        """A place in the queue for a request due at `deadline` (monotonic), decided at once:
        429 (queue full, or it would miss its deadline), 503 (draining), or a Ticket."""
        if self.draining:  # checked again: a request may have been reading its body at SIGTERM
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            return self.admission.reserve(deadline - time.monotonic())
        except Rejected as exc:
            raise self._rejected(exc) from None

    def _rejected(self, exc: Rejected) -> APIError:
        self.metrics.rejections.labels(exc.reason).inc()
        wait = max(0.001, exc.retry_after)
        return APIError(429, str(exc), code=exc.reason,
                        headers={"Retry-After": str(max(1, math.ceil(wait))),
                                 "retry-after-ms": str(max(1, math.ceil(wait * 1000)))})

    async def start(self, prep: Prepared, ticket: Ticket) -> Generation:
        """Wait for the ticket's slot (504 if the deadline passes first), then send to a worker
        (503 without one). Cancellable: a client that leaves meanwhile frees its place. The
        ticket is always either turned into the Generation's slot or given back."""
        try:
            if not self.client.serves(prep.model.model_id):
                # Its workers are draining or gone: waiting in the queue would only end in a 503
                # (or a 504) later, and the admission limit, sized from ready workers, would be 1.
                raise APIError(503, f"no ready worker serves {prep.model.model_id!r}",
                               code="no_worker")
            remaining = prep.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            slot = await ticket.wait(remaining)
        except TimeoutError:
            ticket.cancel()
            raise APIError(504, "the request's deadline passed while it was queued",
                           code="timeout") from None
        except QueueClosed:
            ticket.cancel()
            raise APIError(503, "the server is shutting down", code="shutting_down") from None
        except BaseException:
            ticket.cancel()
            raise
        gen = Generation(self.client, prep.model, new_request_id(), prep.prompt_ids, prep.params,
                         prep.stop, prep.deadline, prep.arrival, slot, grammar=prep.grammar,
                         cache_salt=prep.cache_salt)
        if self.tracer is not None:  # the span opens here so its context reaches the worker
            self.tracer.start(gen)
        try:
            await gen.start()
        except NoWorkerError as exc:
            await gen.close()
            raise APIError(503, str(exc), code="no_worker") from None
        except asyncio.CancelledError:
            await asyncio.shield(gen.close())  # frees the slot; stops the work if it was sent
            raise
        return gen

    # ---- after --------------------------------------------------------------------------------

    def record(self, route: str, status: int, gen: Generation | None, arrival: float,
               request_id: str, finish: str | None = None) -> None:
        """One request ended, by any exit (answered, rejected, refused, aborted, timed out, its
        worker lost): count it, observe its timings, write one structured log line. `finish`
        is the route's word (aborted, timeout) where the choices' own reasons do not say it."""
        now = time.monotonic()
        finish = finish or _finish_reason(status, gen)
        mx = self.metrics
        mx.requests.labels(route, str(status), finish).inc()
        fields: dict[str, Any] = {
            "event": "request_end", "request_id": request_id, "route": route, "status": status,
            "finish_reason": finish, "tokens_in": None, "tokens_out": None, "queue_wait_ms": None,
            "gateway_wait_ms": None, "ttft_ms": None, "tpot_ms": None,
            "total_ms": _ms(now - arrival), "worker": None, "engine_request_id": None}
        if gen is not None:  # it was admitted: it may have reached a worker
            t = gen.timings
            if gen.handle is not None and status == 200 and set(gen.finish_reasons) <= {
                    "stop", "length"}:  # it ran its course: its rates are the worker's
                worker = gen.handle.worker
                self.service_times.observe(worker.hello.worker_id, max(1, worker.stats.running),
                                           gen.prompt_tokens, t.since_scheduled_s, t.tpot())
            mx.e2e.observe(now - arrival)
            mx.prompt_tokens.inc(gen.prompt_tokens)
            mx.generation_tokens.inc(gen.completion_tokens)
            mx.prompt_len.observe(gen.prompt_tokens)
            mx.gen_len.observe(gen.completion_tokens)
            for gap in t.gaps:
                mx.itl.observe(gap)
            queue_wait, tpot = t.queue_wait, t.tpot()
            ttft = None if t.first_token is None else t.first_token - arrival
            for histogram, value in ((mx.queue_wait, queue_wait), (mx.ttft, ttft),
                                     (mx.tpot, tpot)):
                if value is not None:
                    histogram.observe(value)
            fields.update(
                tokens_in=gen.prompt_tokens, tokens_out=gen.completion_tokens,
                queue_wait_ms=_ms(queue_wait), ttft_ms=_ms(ttft), tpot_ms=_ms(tpot),
                # the part of the queue wait spent in the gateway's own admission queue
                gateway_wait_ms=None if t.sent is None else _ms(t.sent - arrival),
                engine_request_id=gen.request_id,
                worker=gen.handle.worker.name if gen.handle else None)
        log.info("request ended", extra={"fields": fields})
        if self.tracer is not None:
            self.tracer.end(route, status, gen, arrival, request_id, finish)


def _finish_reason(status: int, gen: Generation | None) -> str:
    if status in _STATUS_FINISH:
        return _STATUS_FINISH[status]
    if status >= 400:
        return "error"
    reasons = [r for r in (gen.finish_reasons if gen else []) if r]
    reason = reasons[0] if reasons else "none"
    return "aborted" if reason == "abort" else reason  # the worker's word for it


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
