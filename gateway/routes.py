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

from gateway.errors import APIError, error_body, error_response
from gateway.formatters import FORMATTERS, Formatter
from gateway.generation import EngineFailure, Generation
from gateway.service import GatewayState
from gateway.streaming import SSEResponse, sse_event, until_disconnect

DONE = b"data: [DONE]\n\n"
log = logging.getLogger("kestrel.gateway")


async def run_route(request: Request, route: str) -> Response:
    state: GatewayState = request.app.state.gateway
    arrival = time.monotonic()
    request_id = request.state.request_id  # set by errors.CatchAll, returned on every response
    headers = {"X-Request-ID": request_id}
    fmt_cls: type[Formatter] = FORMATTERS[route]
    try:
        state.guard(request)
        body = state.parse(fmt_cls.schema, await state.read_json(request))
        fmt = fmt_cls(state, body)

        async def admit() -> Generation:
            return await state.start(await fmt.prepare(arrival))

        # A client that leaves while its request waits in the queue gives its place back now,
        # not when the request would have reached a worker.
        started = await until_disconnect(request.receive, admit(), _nothing, _close)
        if started is None:
            state.record(route, 499, None, arrival, request_id, "aborted")
            return Response(status_code=499)
        gen = started
    except APIError as exc:
        state.record(route, exc.status, None, arrival, request_id)
        exc.headers = {**exc.headers, **headers}
        raise
    except Exception:  # a bug: errors.CatchAll logs it and answers 500
        state.record(route, 500, None, arrival, request_id)
        raise
    fmt.bind(gen)
    if fmt.stream:
        return _stream(state, route, fmt, gen, arrival, request_id, headers)
    return await _collect(state, request, route, fmt, gen, arrival, request_id, headers)


async def _nothing() -> None:
    return None


async def _close(gen: Generation) -> None:
    await gen.close()


def _stream(state: GatewayState, route: str, fmt: Formatter, gen: Generation, arrival: float,
            request_id: str, headers: dict[str, str]) -> SSEResponse:
    outcome = {"status": 200, "finish": None}

    async def on_disconnect() -> None:
        outcome["finish"] = "aborted"
        await gen.close()

    async def events():  # type: ignore[no-untyped-def]
        try:
            for chunk in fmt.stream_start():
                yield sse_event(chunk)
            async for event in gen.events():
                for chunk in fmt.stream_event(event):
                    yield sse_event(chunk)
            for chunk in fmt.stream_end():
                yield sse_event(chunk)
            if any(r == "timeout" for r in gen.finish_reasons):
                outcome["finish"] = "timeout"
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
                await gen.close()
            state.record(route, int(outcome["status"]), gen, arrival, request_id,
                         outcome["finish"])  # type: ignore[arg-type]
        yield DONE

    return SSEResponse(events(), on_disconnect, headers)


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
