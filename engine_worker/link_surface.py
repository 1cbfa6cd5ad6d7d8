"""The link as the worker loop drives it: one Protocol, met by the real WorkerLink (one gateway),
the LinkSet (a gateway's several API server processes) and the tests' fakes, as EngineSurface
is for the engine; the loop probed it with getattr before (issue 55).

    I/O thread(s) ──inbound (Generate, Cancel, Reset...), cancel_arrivals, rejected──▶ WorkerLoop
    WorkerLoop ──open_outbound().send(frames); stats, draining (read by the heartbeats);
                 forget(rid); reset_scope(reset, ids); quiet(seconds)──▶ I/O thread(s)
    serve() ──start(), stop(dying_reason)──▶ the link's life
"""

from __future__ import annotations

import queue
from collections.abc import Iterable
from typing import Any, Protocol

from protocol import messages as m


class Outbound(Protocol):
    def send(self, msg: Any) -> None:
        """Queue a frame for the gateway (the I/O thread sends it)."""
        ...


class LinkSurface(Protocol):
    inbound: queue.Queue[Any]  # frames from the gateway, for the engine loop
    cancel_arrivals: dict[str, float]  # request id -> when its Cancel reached the I/O thread
    stats: m.Stats  # the engine's, swapped whole by the loop; the heartbeats carry it
    draining: bool  # the heartbeats say so once the loop drains

    @property
    def worker_id(self) -> str:
        """This worker's id, as its Hello announced it."""
        ...

    @property
    def rejected(self) -> str | None:
        """Why a gateway refused this worker's Hello (the loop then ends), or None."""
        ...

    def start(self) -> None:
        """Start the I/O thread(s)."""
        ...

    def stop(self, dying_reason: str | None = None, timeout: float = 2.0) -> None:
        """Say why (WorkerDying) when given, then stop."""
        ...

    def open_outbound(self) -> Outbound:
        """The engine loop's own sender (a socket a thread may use alone)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request is over here: nothing more is routed for it."""
        ...

    def reset_scope(self, msg: m.Reset, request_ids: Iterable[str]) -> list[str]:
        """Which of `request_ids` a gateway's Reset ends (those it sent)."""
        ...

    def quiet(self, seconds: float, wait_s: float = 1.0) -> None:
        """Announce a silence of up to `seconds` (work that holds the GIL) before it starts."""
        ...
