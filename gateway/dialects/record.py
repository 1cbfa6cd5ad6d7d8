"""A dialect declared once: the record of an API the gateway speaks, from which everything that
serves it is built.

    Dialect: its name, the shape of its errors in /openapi.json, and
        Endpoint (one per engine route): path ──▶ the app mounts one Exchange there
                                         route (gateway.prompt.intake.Route: name, schema,
                                             parser, defaults) ──▶ intake reads the body by it
                                         formatter ──▶ the answer, its stream and its errors
                                         summary ──▶ its operation in /openapi.json
        SideRoute (a route of its own, outside the engine's path: Ollama's model listings)
                                         ──▶ mounted as it is, and documented

The records the gateway serves are gateway.dialects.served's DIALECTS; a new dialect is one more
record there (tests/gateway/api/test_toy_dialect.py adds one in a test and serves it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.output.formatters import Formatter
from gateway.prompt.intake import Route


@dataclass(frozen=True)
class Endpoint:
    """One engine route: where it is served, how its body is read, how it is answered."""

    path: str  # POST
    route: Route
    formatter: type[Formatter]
    summary: str  # its operation's in /openapi.json


@dataclass(frozen=True)
class SideRoute:
    """A dialect's route that is not the engine's: a handler of its own, mounted as it is."""

    path: str
    method: str  # "GET" or "POST"
    handler: Callable[[Request], Awaitable[Response]]
    summary: str | None  # its operation's in /openapi.json; None: not in the document


@dataclass(frozen=True)
class Dialect:
    """An API the gateway speaks: its engine routes and its own side routes, and its error body
    as /openapi.json names and describes it (None: OpenAI's, gateway.http.errors)."""

    name: str
    endpoints: tuple[Endpoint, ...]
    side_routes: tuple[SideRoute, ...] = ()
    error_schema: tuple[str, dict[str, Any]] | None = None
