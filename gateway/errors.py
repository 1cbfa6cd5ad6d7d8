"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, never a stack trace.

Handlers raise `APIError` (or let pydantic's ValidationError escape); `install` maps those, plain
HTTP errors (404, 405) and any other exception (logged with its trace, answered 500) to that shape.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger("kestrel.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
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


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return APIError(422, message, param=param, code="invalid_value")


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    return error_response(exc.status_code, message, headers=dict(exc.headers or {}))


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error", code="internal_error")


def install(app: Starlette) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unhandled)
