"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, never a stack trace.

Handlers raise `APIError`; `install` maps it and plain HTTP errors (404, 405) to that shape, and
adds `CatchAll`, which logs any other exception with its trace and answers 500 in that shape.
Starlette's own handler for `Exception` would answer too, but then re-raise into uvicorn, which
logs the trace a second time and drops the keep-alive connection: the client's next request on it
fails with a reset.
"""

from __future__ import annotations

import logging
import math
import re
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kestrel.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",  # nginx's "client closed request": logged, never read
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def too_many_requests(message: str, code: str, wait_s: float) -> APIError:
    """A 429 that says when to come back: Retry-After in whole seconds (HTTP), and
    retry-after-ms, which OpenAI's clients read first, with the exact wait."""
    wait = max(0.001, wait_s)
    return APIError(429, message, code=code,
                    headers={"Retry-After": str(max(1, math.ceil(wait))),
                             "retry-after-ms": str(max(1, math.ceil(wait * 1000)))})


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


# pydantic names the member of a union it tried inside `loc` ("str", "list[str]", "TextPart"...):
# a type, not a field, so it is left out of `param`.
_UNION_MEMBER = re.compile(r"^([A-Z]\w*|str|int|float|bool|none|[\w-]+\[.*\]|constrained-\w+)$")


def _is_member(part: object) -> bool:
    return isinstance(part, str) and bool(_UNION_MEMBER.match(part))


def _path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not _is_member(p))


# A validation error whose message is whole, as a check made by hand once said it (no "param: ").
LIMIT_ERROR = "request_limit"


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    loc, msg, kind = tuple(errors[0]["loc"]), errors[0]["msg"], errors[0]["type"]
    cut = next((i for i, p in enumerate(loc) if _is_member(p)), None)
    if cut is not None:
        # Every member of a union failed. Report the one the value was meant for: a failure that
        # is not a type mismatch ("less than 4294967296"), else the one that got deepest.
        prefix = loc[:cut]
        same = [e for e in errors if tuple(e["loc"][:cut]) == prefix and len(e["loc"]) > cut
                and _is_member(e["loc"][cut])]
        meant = [e for e in same if not e["type"].endswith("_type")]
        if not meant:
            deepest = max(len(e["loc"]) for e in same)
            meant = [e for e in same if len(e["loc"]) == deepest]
        if len(meant) == 1 or not meant[0]["type"].endswith("_type"):
            loc, msg, kind = tuple(meant[0]["loc"]), meant[0]["msg"], meant[0]["type"]
        else:
            loc, msg = prefix, "does not have one of the accepted types"
    param = _path(loc)
    msg = msg.removeprefix("Value error, ")
    return APIError(422, f"{param}: {msg}" if param and kind != LIMIT_ERROR else msg,
                    param=param or None, code="invalid_value")


def validated(schema: type[BaseModel], data: Any, not_object: int = 422) -> Any:
    """`data` as `schema`, or the APIError naming what is wrong (`not_object`, the status for a
    body that is no JSON object: 422 on OpenAI's routes, 400 on Anthropic's and Ollama's)."""
    if not isinstance(data, dict):
        raise APIError(not_object, "the body must be a JSON object", code="invalid_value")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    return error_response(exc.status_code, message, headers=dict(exc.headers or {}))


class CatchAll:
    """ASGI middleware: any exception below it is logged with its trace and answered 500 in the
    error shape (if the response has not started; else the connection just ends), never raised
    into the server. It also gives every request an id (the client's X-Request-ID or a new one,
    in `request.state.request_id`) and returns it on every response, errors included. It counts
    the HTTP requests in progress (`in_flight[0]`): a drain ends when none is left."""

    def __init__(self, app: ASGIApp, in_flight: list[int]) -> None:
        self.app = app
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        request_id = next((v.decode("latin-1") for k, v in scope.get("headers", [])
                           if k == b"x-request-id" and v), None) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        self.in_flight[0] += 1
        try:
            await self.app(scope, receive, watch)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                response = error_response(500, "internal server error", code="internal_error")
                await response(scope, receive, watch)
        finally:
            self.in_flight[0] -= 1


def install(app: Starlette) -> list[int]:
    """The error handlers and CatchAll; returns its count of HTTP requests in progress."""
    in_flight = [0]
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_middleware(CatchAll, in_flight=in_flight)
    return in_flight
