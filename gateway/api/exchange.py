"""The engine's routes (OpenAI's completions, chat completions and embeddings, and the native
API): one request's life at the gateway, from its arrival to its last byte, owned by one object.

    Exchange.run(): auth.guard (401, 429) ──▶ admit.precheck (503, 429) ──▶ heavy.hold (429) ──▶
        intake.read (413/408/400/422) ──▶ [--models-dir: its claim granted: 503, 504, 429] ──▶
        admit.reserve (429: the Ticket) ──▶ intake.prepare (tokens, in a thread) ──▶
        admit.check_fit (400, 429) ──▶ admit.seat (the Slot: 504, 503) ──▶ a Generation
        started at a worker ──▶ collected (JSON), or streamed (SSE)

    Exchange.close(), once, whatever the exit: the ticket given back, or the generation stopped
        and its slot released with what was served (admission learns the drain rate from that
        event), then accounting.record (metrics, the log line, the span's end)

A stream is answered 200 as soon as nothing but waiting is left (its model loading, its place in
the queue): the rest of its way in runs inside the stream, each refusal an event, and the stream
takes the exchange over (its own `finally` closes it). A client that leaves at any point gives its
place back at once (499).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from gateway.admission.queue import Served, Slot, Ticket
from gateway.dialects.record import Endpoint
from gateway.engine.engine_client import NoWorkerError
from gateway.engine.on_demand import Claim
from gateway.http.errors import APIError
from gateway.http.streaming import ClientGone, SSEResponse, unless_gone
from gateway.output.formatters import Formatter
from gateway.output.generation import EngineFailure, Generation
from gateway.prompt.intake import Draft, EngineRequest
from gateway.service import GatewayState

log = logging.getLogger("kestrel.gateway")


async def answer(request: Request, endpoint: Endpoint) -> Response:
    """The handler of every engine route (gateway.api.app mounts it once per dialect record's
    endpoint): one Exchange, closed here, or by its stream when a stream took it over."""
    exchange = Exchange(request.app.state.gateway, request, endpoint)
    try:
        return await exchange.run()
    finally:
        if not exchange.streaming:  # a stream closes it when it ends
            with anyio.CancelScope(shield=True):
                await exchange.close()


class Exchange:
    """A request and everything it holds: its ticket, then its slot and generation; its outcome
    (status, finish) and its one accounting record."""

    def __init__(self, state: GatewayState, request: Request, endpoint: Endpoint) -> None:
        self.state, self.request, self.endpoint = state, request, endpoint
        self.route = endpoint.route.name  # its metrics' and log line's label
        self.shape = endpoint.formatter  # its answer's, its stream's and its errors' shapes
        self.arrival = time.monotonic()
        self.request_id: str = request.state.request_id  # set by errors.CatchAll
        self.headers = {"X-Request-ID": self.request_id}
        self.ticket: Ticket | None = None  # a place in the queue, until it becomes a slot
        self.slot: Slot | None = None
        self.req: EngineRequest | None = None
        self.gen: Generation | None = None
        self.status: int | None = None  # None: never answered (the server stopped first)
        self.finish: str | None = None  # the route's word (aborted, timeout), where it says more
        self.streaming = False  # a stream took it over: the stream closes it
        self.claim: Claim | None = None  # --models-dir: its hold on its model, until reserved
        self._recorded = False

    async def run(self) -> Response:
        """The route's answer; the exchange is closed by its caller or by its stream."""
        try:
            return await self._answer()
        except ClientGone:
            self.status, self.finish = 499, "aborted"  # nginx's "client closed request"
            return Response(status_code=499)
        except (APIError, EngineFailure) as exc:
            self.status = exc.status
            status, body = self.shape.error_shape(
                exc.status, exc.message, getattr(exc, "param", None), exc.code)
            return JSONResponse(body, status, {**getattr(exc, "headers", {}), **self.headers})
        except Exception:  # a bug: errors.CatchAll logs it and answers 500
            self.status = 500
            raise

    async def _answer(self) -> Response:
        state, request, gone = self.state, self.request, self.request.receive
        key = state.auth.guard(request)
        client = state.auth.client(request, key)
        state.admit.precheck()  # a 429 costs no body read, no tokenizing, no thread
        with state.heavy.hold(request, client):  # a large body: 429?
            draft = await state.intake.read(self.endpoint.route, request, self.arrival)
            pool = state.models_on_demand
            if pool is not None:  # --models-dir: a claim on its model until it has its place
                self.claim = pool.claim(draft.body.model, draft.deadline)
                if draft.stream and not self.claim.granted:
                    # answer 200 now and keep it alive while the worker starts
                    return self._stream(draft.deadline, self._way_in(draft, key))
                # The granted claim keeps its model from eviction until the reservation.
                await unless_gone(gone, _granted(self.claim))
            req = await self._admitted(draft, key, gone)
        if draft.stream and not self.ticket.granted:
            # It waits in the queue: answer 200 now and keep the stream alive with comments
            # while it waits (a proxy would cut a silent one); errors from here on are events.
            return self._stream(req.deadline, self._start(req))
        self.slot = await unless_gone(gone, state.admit.seat(req, self._ticket_out()))
        await self._send(req)
        if draft.stream:
            return self._stream(req.deadline)
        return await self._collect()

    async def _way_in(self, draft: Draft, key: str | None) -> None:
        """A stream's way in while its model loads, run inside the stream: the model, its place
        in the queue, its tokens, the fit, its start."""
        assert self.claim is not None
        await self.claim.wait()
        await self._start(await self._admitted(draft, key))

    async def _admitted(self, draft: Draft, key: str | None,
                        gone: Receive | None = None) -> EngineRequest:
        """The one admission sequence, whichever way a request came in: the 429 decision (a
        ticket: a place in the queue, or a slot) before tokenizing, with no await between a
        granted claim and it; the claim handed over to admission, which counts the request for
        its model from here on; the tokens, while the ticket holds its place (ClientGone if
        `gone` says the client left); the fit: 400 or 429 now, not a 504 after the deadline."""
        state = self.state
        self.ticket = state.admit.reserve(draft)
        self._unclaim()
        prepared = state.intake.prepare(draft, key)
        req = await (prepared if gone is None else unless_gone(gone, prepared))
        state.admit.check_fit(req, self.ticket)
        return req

    def _ticket_out(self) -> Ticket:
        """The ticket, handed to admit.seat, which always turns it into the slot or gives it
        back."""
        ticket, self.ticket = self.ticket, None
        assert ticket is not None
        return ticket

    async def _start(self, req: EngineRequest) -> None:
        """Its slot (waiting in the queue for it), then its generation sent to a worker."""
        self.slot = await self.state.admit.seat(req, self._ticket_out())
        await self._send(req)

    async def _send(self, req: EngineRequest) -> None:
        """A Generation for `req`, in the slot it holds, sent to a worker (503 if none)."""
        assert self.slot is not None
        self.req = req
        gen = Generation(self.state.client, req.model, req.prompt_ids,
                         req.params, req.stop, req.deadline, req.arrival, grammar=req.grammar,
                         cache_salt=req.cache_salt, skip_special_tokens=req.skip_special_tokens,
                         include_stop=req.include_stop, input_lengths=req.input_lengths)
        self.gen = gen
        if self.slot.work is not None:  # the backlog counts what it has left from now on
            self.slot.work.generated = gen.longest_choice
        self.state.accounting.opened(gen)  # the span opens now so its context reaches the worker
        try:
            await gen.start()
        except NoWorkerError as exc:
            raise APIError(503, str(exc), code="no_worker") from None

    async def _collect(self) -> Response:
        gen, req = self.gen, self.req
        assert req is not None and gen is not None
        result = await unless_gone(self.request.receive, self.shape(req, gen).collect())
        if gen.timed_out:
            self.finish = "timeout"
            raise APIError(504, "the request's deadline passed before it finished",
                           code="timeout")
        self.status = 200
        return JSONResponse(result, headers=self.headers)

    def _stream(self, deadline: float | None, opening: Awaitable[None] | None = None
                ) -> SSEResponse:
        """The SSE answer, for the started generation or for the way in that `opening` runs
        inside the stream; its errors are events, and the stream closes the exchange."""
        self.streaming, self.status = True, 200

        async def on_disconnect() -> None:
            self.finish = "aborted"
            await self.release()

        shape = self.shape
        return SSEResponse(self._events(opening), on_disconnect, self.headers, deadline=deadline,
                           keepalive_s=self.state.cfg.sse_keepalive_s,
                           send_timeout_s=self.state.cfg.send_timeout_s,
                           media_type=shape.media_type, keepalive=shape.keepalive)

    async def _events(self, opening: Awaitable[None] | None) -> AsyncIterator[bytes]:
        shape = self.shape  # the dialect: its framing and its error events
        fmt: Formatter | None = None  # its error events, once it is built
        try:
            if opening is not None:
                await opening
            assert self.req is not None and self.gen is not None
            gen, fmt = self.gen, shape(self.req, self.gen)
            # Each step's chunks leave in one write (a socket write per chunk costs the loop).
            if chunks := fmt.stream_start():
                yield b"".join(map(shape.frame, chunks))
            async for event in gen.events():
                if chunks := fmt.stream_event(event):
                    yield b"".join(map(shape.frame, chunks))
            if chunks := fmt.stream_end():
                yield b"".join(map(shape.frame, chunks))
            if gen.timed_out:
                self.finish = "timeout"
        except (APIError, EngineFailure) as exc:  # opening's refusals, a lost worker, ...
            self.status = exc.status
            yield shape.frame((fmt.stream_error if fmt else shape.error_chunk)(
                exc.status, exc.message, exc.code))
        except Exception:
            # A bug, after the 200 went out: log the trace, tell the client in the stream's
            # error shape (never the trace), and still end the stream as the dialect does.
            log.exception("unhandled error in a %s stream", self.route)
            self.status = 500
            yield shape.frame((fmt.stream_error if fmt else shape.error_chunk)(
                500, "internal server error", "internal_error"))
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()
        if shape.closing:
            yield shape.closing

    async def release(self) -> None:
        """Give back what it holds now: its place in the queue, or its generation (stopped at the
        worker if it may still run) and its slot, with what the worker served. Idempotent, and
        safe to call again after a way in that was still running took something more."""
        self._unclaim()
        if self.ticket is not None:
            self.ticket.cancel()
            self.ticket = None
        gen, slot = self.gen, self.slot
        if gen is not None:
            await gen.close()
        if slot is not None:
            # A retry may have moved the request to another worker: the one that ends it counts.
            worker = None if gen is None else gen.worker_id
            slot.release(None if gen is None or worker is None else Served(worker, gen.ran))

    def _unclaim(self) -> None:
        if self.claim is not None:
            self.claim.release()
            self.claim = None

    async def close(self) -> None:
        """Release, then write it down once (nothing for a request the server's stop cut)."""
        await self.release()
        if self.status is not None and not self._recorded:
            self._recorded = True
            self.state.accounting.record(self.route, self.status, self.gen, self.arrival,
                                         self.request_id, self.finish)


async def _granted(claim: Claim) -> bool:
    await claim.wait()
    return True
