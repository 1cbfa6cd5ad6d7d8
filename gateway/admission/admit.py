"""Admission at the gateway: who gets a place, and when a request is handed to a worker.

    precheck (before the body is read): 503 draining, 429 if the queue is full
        ──▶ reserve(draft): 503 draining, 429 queue full or a deadline out of reach behind the
        backlog, else a Ticket (its Work counted in the backlog) ──▶ (tokenizing) ──▶
        check_fit (a deadline only): 400 if it could not finish even on an idle worker, 429 if
        not behind the backlog ──▶ seat: wait for the slot (504 at a deadline; 503 when no
        ready worker serves the model) ──▶ the Slot, whose Work the backlog counts until the
        slot is released

The queue itself is gateway.admission.queue, one per model, the estimate gateway.admission.backlog;
a model's limit is max_outstanding, or the sequences its ready workers announced. A request without
a deadline is never refused on an estimate. Draining is checked before the body is read and again
after (SIGTERM may come while a body arrives); a request already queued is failed by
reject_waiters.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Counter

from gateway.admission.backlog import Capacity, Work, capacity_of
from gateway.admission.queue import Admissions, QueueClosed, Rejected, Slot, Ticket
from gateway.config import GatewayConfig
from gateway.engine.engine_client import EngineClient
from gateway.http.errors import APIError, too_many_requests
from gateway.prompt.intake import Draft, EngineRequest


class Admitter:
    def __init__(self, cfg: GatewayConfig, client: EngineClient, rejections: Counter) -> None:
        self.cfg = cfg
        self.client = client
        self.rejections = rejections
        self.draining = False
        # Per model, read at each decision: by default the seats of its ready workers.
        fixed = cfg.max_outstanding
        registry = client.registry
        self.limit: Callable[[str], int] = (lambda _model: fixed) if fixed else registry.seats
        self.admission = Admissions(self.limit, cfg.max_queue, workers=registry.worker_ids,
                                    capacity=self.capacity)

    def capacity(self, model: str) -> Capacity | None:
        """The model's ready workers: their measured step costs and seats."""
        return capacity_of([(w.stats.step_costs, w.hello.max_num_seqs)
                            for w in self.client.registry.candidates(model)])

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")

    def _rejected(self, exc: Rejected) -> APIError:
        self.rejections.labels(exc.reason).inc()
        return too_many_requests(str(exc), exc.reason, exc.retry_after)

    def precheck(self) -> None:
        """Before the body is read: 429 at once if the queue is full, so a refused request
        costs no body read, no tokenizing and no thread."""
        self._refuse_if_draining()
        try:
            self.admission.check()
        except Rejected as exc:
            raise self._rejected(exc) from None

    def reserve(self, draft: Draft) -> Ticket:
        """A place in the queue for `draft`, decided at once: 429 (queue full, or a deadline it
        would miss behind the backlog), 503 (draining), or a Ticket. Its prompt counts as its
        characters until it is tokenized; an absent max_tokens as the most it may become."""
        self._refuse_if_draining()  # again: a request may have been reading its body at SIGTERM
        body, registry = draft.body, self.client.registry
        entry = registry.model(body.model) if body.model else next(iter(registry.models.values()),
                                                                     None)
        asked = body.requested_max_tokens()
        route = draft.route
        most = entry.hello.max_model_len if entry is not None else 1
        tokens = (asked or min(route.default_max_tokens or most, self.cfg.max_tokens_cap, most)
                  if route.generates else 0)  # embeddings: the prompt is all their work
        work = Work(entry.model_id if entry is not None else "", max(1, draft.prompt_chars),
                    tokens, getattr(body, "n", None) or 1, draft.deadline)
        try:
            return self.admission.of(work.model).reserve(work)
        except Rejected as exc:
            raise self._rejected(exc) from None

    def check_fit(self, req: EngineRequest, ticket: Ticket) -> None:
        """After tokenizing, its exact prompt replaces the estimate in the backlog; with a
        deadline, 400 if it could not finish before it even on an idle worker, 429 if not
        behind the work admitted before it (or not without making that work late)."""
        work = ticket.work
        if work is None:
            return
        work.model, work.prompt_tokens = req.model.model_id, len(req.prompt_ids)
        work.max_tokens, work.n = (0, 1) if req.embed else (req.params.max_tokens, req.params.n)
        if req.deadline is not None:
            budget, remaining = req.deadline - req.arrival, req.deadline - time.monotonic()
            idle = ticket.admission.backlog.idle_s(work)
            if remaining <= 0 or (idle is not None and idle > budget):
                least = f"about {idle:.1f} s" if idle is not None else "more"
                raise APIError(400, f"this request cannot finish within its timeout of "
                               f"{budget:.3g} s even on an idle worker ({least} for "
                               f"{len(req.prompt_ids)} prompt tokens and max_tokens="
                               f"{work.max_tokens}): lower max_tokens or raise timeout",
                               param="max_tokens" if remaining > 0 else "timeout",
                               code="deadline_unreachable")
        try:
            ticket.admission.refine(work, ticket.granted)
        except Rejected as exc:
            raise self._rejected(exc) from None

    async def seat(self, req: EngineRequest, ticket: Ticket) -> Slot:
        """Wait for the ticket's slot (504 if the deadline passes first; 503 if no ready worker
        serves its model, or the server stops). Cancellable: a client that leaves meanwhile
        frees its place. The ticket always either becomes the slot or is given back."""
        try:
            if not self.client.serves(req.model.model_id):
                # Its workers are draining or gone: waiting in the queue would only end in a 503
                # (or a 504) later, and the admission limit, sized from ready workers, would be 1.
                raise APIError(503, f"no ready worker serves {req.model.model_id!r}",
                               code="no_worker")
            remaining = None if req.deadline is None else req.deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            return await ticket.wait(remaining)
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
