"""The engine's routes: OpenAI's completions, chat completions and embeddings, and the native
API.

One way through, whatever the route (`run_route`):

    auth.guard (401, 429) ──▶ admit.precheck (503, 429) ──▶ heavy.hold (429: a client's large
    bodies, a few at once) ──▶ intake.read (413/408/400/422) ──▶ with --models-dir, its model
    loaded (gateway.engine.on_demand: 503 if it fails to load, 504 at the deadline)
    ──▶ admit.reserve (429) ──▶ intake.prepare (tokens, in a thread) ──▶ admit.check_fit
    ──▶ admit.start (wait for the slot: 504; to a worker: 503) ──▶ the route's formatter,
        streamed (SSE) or collected ──▶ accounting.record, on every exit

A client that leaves at any point gives its place back at once (499).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission.queue import Ticket
from gateway.api.errors import APIError, error_body, error_response
from gateway.api.streaming import SSEResponse, sse_event, until_disconnect
from gateway.engine.on_demand import OnDemand
from gateway.output.formatters import FORMATTERS, Formatter
from gateway.output.generation import EngineFailure, Generation
from gateway.prompt.intake import Draft, EngineRequest
from gateway.service import GatewayState

DONE = b"data: [DONE]\n\n"
log = logging.getLogger("kestrel.gateway")


async def run_route(request: Request, route: str) -> Response:
    state: GatewayState = request.app.state.gateway
    record = state.accounting.record
    arrival = time.monotonic()
    request_id = request.state.request_id  # set by errors.CatchAll, returned on every response
    headers = {"X-Request-ID": request_id}
    ticket: Ticket | None = None
    try:
        key = state.auth.guard(request)
        state.admit.precheck()  # a 429 costs no body read, no tokenizing, no thread
        with state.heavy.hold(request, state.auth.client(request, key)):  # a large body: 429?
            draft = await state.intake.read(route, request, arrival)
            pool = state.models_on_demand
            if pool is not None and draft.stream and not pool.ready(draft.body.model):
                # --models-dir, a stream whose model is not loaded: answer 200 now and keep it
                # alive while the worker starts; the rest of its way in runs inside the stream
                loading = _Loading(state, draft, key)
                return _stream(state, route, arrival, draft.deadline, request_id, headers,
                               opening=loading.open, abandon=loading.abandon)
            if pool is not None:  # --models-dir: its model's worker started and joined first
                loaded = await until_disconnect(request.receive,
                                                _loaded(pool, draft.body.model, draft.deadline),
                                                _nothing)
                if loaded is None:
                    record(route, 499, None, arrival, request_id, "aborted")
                    return Response(status_code=499)
            # no await from here to the reservation: an idle model is unloaded only between
            ticket = state.admit.reserve(draft)  # the 429 decision, before tokenizing
            # Tokenizing happens while the ticket holds its place (or its slot) in the queue; a
            # client that leaves meanwhile gives it back at once.
            prepared = await until_disconnect(request.receive, state.intake.prepare(draft, key),
                                              _nothing)
        if prepared is None:
            ticket.cancel()
            record(route, 499, None, arrival, request_id, "aborted")
            return Response(status_code=499)
        req = prepared
        state.admit.check_fit(req, ticket)  # 400 or 429 now, not a 504 after the deadline
        if draft.stream and not ticket.granted:
            # It waits in the queue: answer 200 now and keep the stream alive with comments
            # while it waits (a proxy would cut a silent one); errors from here on are events.
            pending = ticket

            async def from_queue() -> tuple[EngineRequest, Generation]:
                return req, await state.admit.start(req, pending)

            return _stream(state, route, arrival, req.deadline, request_id, headers,
                           opening=from_queue, abandon=pending.cancel)
        start, ticket = state.admit.start(req, ticket), None  # it always gives the ticket back
        # A client that leaves while its request waits in the queue gives its place back now,
        # not when the request would have reached a worker.
        started = await until_disconnect(request.receive, start, _nothing, _close)
        if started is None:
            record(route, 499, None, arrival, request_id, "aborted")
            return Response(status_code=499)
        gen = started
    except APIError as exc:
        if ticket is not None:
            ticket.cancel()
        record(route, exc.status, None, arrival, request_id)
        exc.headers = {**exc.headers, **headers}
        raise
    except Exception:  # a bug: errors.CatchAll logs it and answers 500
        if ticket is not None:
            ticket.cancel()
        record(route, 500, None, arrival, request_id)
        raise
    except BaseException:  # cancelled (the server is stopping): give the place back
        if ticket is not None:
            ticket.cancel()
        raise
    if draft.stream:
        return _stream(state, route, arrival, req.deadline, request_id, headers, req, gen)
    return await _collect(state, request, req, FORMATTERS[route](req, gen), request_id, headers)


async def _nothing() -> None:
    return None


async def _loaded(pool: OnDemand, model: str | None, deadline: float | None) -> bool:
    await pool.ensure(model, deadline)
    return True


async def _close(gen: Generation) -> None:
    await gen.close()


class _Loading:
    """A stream's way in while its model loads (--models-dir), run inside the stream: the
    model, its place in the queue, its tokens, the fit, its start; each refusal an event."""

    def __init__(self, state: GatewayState, draft: Draft, key: str | None) -> None:
        self.state, self.draft, self.key = state, draft, key
        self.ticket: Ticket | None = None

    async def open(self) -> tuple[EngineRequest, Generation]:
        state, draft = self.state, self.draft
        assert state.models_on_demand is not None
        await state.models_on_demand.ensure(draft.body.model, draft.deadline)
        self.ticket = state.admit.reserve(draft)  # no await since the model was found ready
        req = await state.intake.prepare(draft, self.key)
        state.admit.check_fit(req, self.ticket)
        ticket, self.ticket = self.ticket, None
        return req, await state.admit.start(req, ticket)  # it always gives the ticket back

    def abandon(self) -> None:
        if self.ticket is not None:
            self.ticket.cancel()
            self.ticket = None


def _stream(state: GatewayState, route: str, arrival: float, deadline: float | None,
            request_id: str, headers: dict[str, str], req: EngineRequest | None = None,
            gen: Generation | None = None,
            opening: Callable[[], Awaitable[tuple[EngineRequest, Generation]]] | None = None,
            abandon: Callable[[], None] | None = None) -> SSEResponse:
    """The SSE answer of a stream: for `gen`, or for the request that `opening` starts inside
    the stream (one waiting in the queue for its ticket, or for its model to load), its
    errors sent as events; `abandon` gives back what it holds when the client leaves first."""
    outcome: dict[str, Any] = {"status": 200, "finish": None, "gen": gen}

    async def on_disconnect() -> None:
        outcome["finish"] = "aborted"
        if outcome["gen"] is not None:
            await outcome["gen"].close()
        elif abandon is not None:
            abandon()

    async def events():  # type: ignore[no-untyped-def]
        try:
            opened_req = req
            if outcome["gen"] is None:
                assert opening is not None
                opened_req, outcome["gen"] = await opening()
            assert opened_req is not None
            g: Generation = outcome["gen"]
            fmt = FORMATTERS[route](opened_req, g)
            # Each step's chunks leave in one write (a socket write per chunk costs the loop).
            if chunks := fmt.stream_start():
                yield b"".join(map(sse_event, chunks))
            async for event in g.events():
                if chunks := fmt.stream_event(event):
                    yield b"".join(map(sse_event, chunks))
            if chunks := fmt.stream_end():
                yield b"".join(map(sse_event, chunks))
            if "timeout" in g.finish_reasons:
                outcome["finish"] = "timeout"
        except APIError as exc:  # from opening it: a 504, a 503, a refusal of its way in
            outcome["status"] = exc.status
            yield sse_event(error_body(exc.status, exc.message, code=exc.code))
        except EngineFailure as exc:
            outcome["status"] = exc.status
            yield sse_event(error_body(exc.status, exc.message, code=exc.code))
        except Exception:
            # A bug, after the 200 went out: log the trace, tell the client in the stream's
            # error shape (never the trace), and still end with [DONE].
            log.exception("unhandled error in a %s stream", route)
            outcome["status"] = 500
            yield sse_event(error_body(500, "internal server error", code="internal_error"))
        finally:
            with anyio.CancelScope(shield=True):
                if outcome["gen"] is not None:
                    await outcome["gen"].close()
                elif abandon is not None:
                    abandon()
            state.accounting.record(route, int(outcome["status"]), outcome["gen"], arrival,
                                    request_id, outcome["finish"])
        yield DONE

    return SSEResponse(events(), on_disconnect, headers, deadline=deadline,
                       keepalive_s=state.cfg.sse_keepalive_s,
                       send_timeout_s=state.cfg.send_timeout_s)


async def _collect(state: GatewayState, request: Request, req: EngineRequest, fmt: Formatter,
                   request_id: str, headers: dict[str, str]) -> Response:
    gen = fmt.gen

    async def collect() -> dict[str, Any]:
        async for event in gen.events():
            fmt.add(event)
        return fmt.response()

    status, finish = 200, None
    try:
        result = await until_disconnect(request.receive, collect(), gen.close)
        if result is None:
            status, finish = 499, "aborted"  # nginx's "client closed request": nobody reads it
            return Response(status_code=499)
        if "timeout" in gen.finish_reasons:
            status, finish = 504, "timeout"
            return error_response(504, "the request's deadline passed before it finished",
                                  code="timeout", headers=headers)
        return JSONResponse(result, headers=headers)
    except EngineFailure as exc:
        status = exc.status
        return error_response(exc.status, exc.message, code=exc.code, headers=headers)
    except Exception:  # a bug: errors.CatchAll logs it and answers 500
        status = 500
        raise
    finally:
        await gen.close()
        state.accounting.record(req.route, status, gen, req.arrival, request_id, finish)


async def completions(request: Request) -> Response:
    return await run_route(request, "completions")


async def chat_completions(request: Request) -> Response:
    return await run_route(request, "chat")


async def embeddings(request: Request) -> Response:
    return await run_route(request, "embeddings")


async def generate(request: Request) -> Response:
    return await run_route(request, "generate")


async def generate_stream(request: Request) -> Response:
    return await run_route(request, "generate_stream")
