"""Admission at the gateway: who gets a place, and when a request is handed to a worker.

    precheck (before the body is read): 503 draining, 429 if even the longest deadline would
        find no place ──▶ reserve(deadline): 503 draining, 429 queue full or deadline out of
        reach, else a Ticket ──▶ (tokenizing) ──▶ check_fit: 400 if it could not finish even on
        an idle worker, 429 if not at the current load ──▶ start: wait for the slot (504), send
        it to a worker (503 without one) ──▶ a live Generation

The queue itself is gateway.admission; its limit is max_outstanding, or the sequences the ready
workers announced. Draining is checked before the body is read and again after (SIGTERM may
come while a body arrives); a request already queued is failed by reject_waiters.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import Counter

from gateway.accounting import Accounting
from gateway.admission import Admission, QueueClosed, Rejected, Ticket, WouldMissDeadline
from gateway.config import GatewayConfig
from gateway.drain import DrainEstimator
from gateway.engine_client import EngineClient, NoWorkerError, new_request_id
from gateway.errors import APIError, too_many_requests
from gateway.generation import Generation
from gateway.intake import EngineRequest
from gateway.service_time import DoesNotFit, ServiceTimes, check_fit


class Admitter:
    def __init__(self, cfg: GatewayConfig, client: EngineClient, service_times: ServiceTimes,
                 accounting: Accounting, rejections: Counter) -> None:
        self.cfg = cfg
        self.client = client
        self.service_times = service_times
        self.accounting = accounting
        self.rejections = rejections
        self.draining = False
        # The limit is read at each decision: by default it follows the workers that are ready.
        fixed = cfg.max_outstanding
        self.limit: Callable[[], int] = (lambda: fixed) if fixed else client.registry.capacity
        self.admission = Admission(self.limit, cfg.max_queue, DrainEstimator(),
                                   workers=client.registry.ready_ids, cold_queue=self.limit)

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")

    def _rejected(self, exc: Rejected) -> APIError:
        self.rejections.labels(exc.reason).inc()
        return too_many_requests(str(exc), exc.reason, exc.retry_after)

    def precheck(self) -> None:
        """Before the body is read: 429 at once if even the longest deadline would not get a
        place, so a refused request costs no body read, no tokenizing and no thread."""
        self._refuse_if_draining()
        try:
            self.admission.check(self.cfg.default_timeout_s)
        except Rejected as exc:
            raise self._rejected(exc) from None

    def reserve(self, deadline: float) -> Ticket:
        """A place in the queue for a request due at `deadline` (monotonic), decided at once:
        429 (queue full, or it would miss its deadline), 503 (draining), or a Ticket."""
        self._refuse_if_draining()  # again: a request may have been reading its body at SIGTERM
        try:
            return self.admission.reserve(deadline - time.monotonic())
        except Rejected as exc:
            raise self._rejected(exc) from None

    def check_fit(self, req: EngineRequest, ticket: Ticket) -> None:
        """After tokenizing: 400 if this request could not finish before its deadline even on
        an idle worker, 429 if not at the current load (gateway/service_time.py)."""
        now = time.monotonic()
        wait = 0.0 if ticket.granted else (self.admission.expected_wait() or 0.0)
        try:
            check_fit(self.service_times, self.client.load(req.model.model_id),
                      len(req.prompt_ids), req.params.max_tokens, req.params.n,
                      req.deadline - req.arrival, req.deadline - now, wait)
        except DoesNotFit as exc:
            if exc.idle:
                raise APIError(400, str(exc), param=exc.param,
                               code="deadline_unreachable") from None
            raise self._rejected(WouldMissDeadline(str(exc), exc.retry_after)) from None

    async def start(self, req: EngineRequest, ticket: Ticket) -> Generation:
        """Wait for the ticket's slot (504 if the deadline passes first), then send to a worker
        (503 without one). Cancellable: a client that leaves meanwhile frees its place. The
        ticket is always either turned into the Generation's slot or given back."""
        try:
            if not self.client.serves(req.model.model_id):
                # Its workers are draining or gone: waiting in the queue would only end in a 503
                # (or a 504) later, and the admission limit, sized from ready workers, would be 1.
                raise APIError(503, f"no ready worker serves {req.model.model_id!r}",
                               code="no_worker")
            remaining = req.deadline - time.monotonic()
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
        gen = Generation(self.client, req.model, new_request_id(), req.prompt_ids, req.params,
                         req.stop, req.deadline, req.arrival, slot, grammar=req.grammar,
                         cache_salt=req.cache_salt)
        self.accounting.opened(gen)  # the span opens here so its context reaches the worker
        try:
            await gen.start()
        except NoWorkerError as exc:
            await gen.close()
            raise APIError(503, str(exc), code="no_worker") from None
        except asyncio.CancelledError:
            await asyncio.shield(gen.close())  # frees the slot; stops the work if it was sent
            raise
        return gen
