"""The generation routes: OpenAI's completions and chat completions, and the native API.

Each route is a Formatter (how a body becomes a Prepared request, how ChoiceEvents become chunks
or a response) run by `run_route`, which owns the shared life: guard, admission, streaming or
collecting, disconnects, deadlines, errors, and the final record.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission import Ticket
from gateway.errors import APIError, error_body, error_response
from gateway.formatters import FORMATTERS, Formatter
from gateway.generation import EngineFailure, Generation
from gateway.service import GatewayState, Prepared
from gateway.streaming import SSEResponse, sse_event, until_disconnect
from gateway.tenancy import cache_salt

DONE = b"data: [DONE]\n\n"
log = logging.getLogger("kestrel.gateway")


async def run_route(request: Request, route: str) -> Response:
    state: GatewayState = request.app.state.gateway
    arrival = time.monotonic()
    request_id = request.state.request_id  # set by errors.CatchAll, returned on every response
    headers = {"X-Request-ID": request_id}
    fmt_cls: type[Formatter] = FORMATTERS[route]
    ticket: Ticket | None = None
    try:
        key = state.guard(request)
        state.precheck()  # a 429 costs no body read, no tokenizing, no thread
        body = state.parse(fmt_cls.schema, await state.read_json(request))
        fmt = fmt_cls(state, body)
        deadline = state.deadline(arrival, getattr(body, "timeout", None))
        ticket = state.reserve(deadline)  # the 429 decision, before tokenizing
        # Tokenizing happens while the ticket holds its place (or its slot) in the queue; a
        # client that leaves meanwhile gives it back at once.
        prepared = await until_disconnect(request.receive, fmt.prepare(arrival), _nothing)
        if prepared is None:
            ticket.cancel()
            state.record(route, 499, None, arrival, request_id, "aborted")
            return Response(status_code=499)
        prep = prepared
        prep.cache_salt = cache_salt(key, getattr(body, "cache_salt", None))
        state.check_fit(prep, ticket)  # 400 or 429 now, not a 504 after the deadline
        if fmt.stream and not ticket.granted:
            # It waits in the queue: answer 200 now and keep the stream alive with comments
            # while it waits (a proxy would cut a silent one); errors from here on are events.
            return _stream(state, route, fmt, None, arrival, request_id, headers,
                           pending=(prep, ticket))
        waiting, ticket = ticket, None  # state.start owns it now: it always gives it back

        async def admit() -> Generation:
            return await state.start(prep, waiting)

        # A client that leaves while its request waits in the queue gives its place back now,
        # not when the request would have reached a worker.
        started = await until_disconnect(request.receive, admit(), _nothing, _close)
        if started is None:
            state.record(route, 499, None, arrival, request_id, "aborted")
            return Response(status_code=499)
        gen = started
    except APIError as exc:
        if ticket is not None:
            ticket.cancel()
        state.record(route, exc.status, None, arrival, request_id)
        exc.headers = {**exc.headers, **headers}
        raise
    except Exception:  # a bug: errors.CatchAll logs it and answers 500
        if ticket is not None:
            ticket.cancel()
        state.record(route, 500, None, arrival, request_id)
        raise
    except BaseException:  # cancelled (the server is stopping): give the place back
        if ticket is not None:
            ticket.cancel()
        raise
    fmt.bind(gen)
    if fmt.stream:
        return _stream(state, route, fmt, gen, arrival, request_id, headers)
    return await _collect(state, request, route, fmt, gen, arrival, request_id, headers)


async def _nothing() -> None:
    return None


async def _close(gen: Generation) -> None:
    await gen.close()


def _stream(state: GatewayState, route: str, fmt: Formatter, gen: Generation | None,
            arrival: float, request_id: str, headers: dict[str, str],
            pending: tuple[Prepared, Ticket] | None = None) -> SSEResponse:
    """The SSE answer of a stream: for `gen`, or, with `pending`, for the request that waits
    in the queue for its ticket (started inside the stream, its errors sent as events)."""
    outcome: dict[str, Any] = {"status": 200, "finish": None, "gen": gen}

    async def on_disconnect() -> None:
        outcome["finish"] = "aborted"
        if outcome["gen"] is not None:
            await outcome["gen"].close()
        elif pending is not None:
            pending[1].cancel()

    async def events():  # type: ignore[no-untyped-def]
        try:
            if outcome["gen"] is None:
                assert pending is not None
                outcome["gen"] = await state.start(*pending)
                fmt.bind(outcome["gen"])
            g: Generation = outcome["gen"]
            for chunk in fmt.stream_start():
                yield sse_event(chunk)
            async for event in g.events():
                for chunk in fmt.stream_event(event):
                    yield sse_event(chunk)
            for chunk in fmt.stream_end():
                yield sse_event(chunk)
            if any(r == "timeout" for r in g.finish_reasons):
                outcome["finish"] = "timeout"
        except APIError as exc:  # from starting a queued request: 504, 503
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
                elif pending is not None:
                    pending[1].cancel()
            state.record(route, int(outcome["status"]), outcome["gen"], arrival, request_id,
                         outcome["finish"])
        yield DONE

    deadline = gen.deadline if gen is not None else pending[0].deadline  # type: ignore[index]
    return SSEResponse(events(), on_disconnect, headers, deadline=deadline,
                       keepalive_s=state.cfg.sse_keepalive_s,
                       send_timeout_s=state.cfg.send_timeout_s)


async def _collect(state: GatewayState, request: Request, route: str, fmt: Formatter,
                   gen: Generation, arrival: float, request_id: str,
                   headers: dict[str, str]) -> Response:
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
        if any(r == "timeout" for r in gen.finish_reasons):
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
        state.record(route, status, gen, arrival, request_id, finish)


async def completions(request: Request) -> Response:
    return await run_route(request, "completions")


async def chat_completions(request: Request) -> Response:
    return await run_route(request, "chat")


async def generate(request: Request) -> Response:
    return await run_route(request, "generate")


async def generate_stream(request: Request) -> Response:
    return await run_route(request, "generate_stream")
