"""uvicorn's h11 protocol with two timers uvicorn lacks, one per connection:

    connection opens / first byte of a request ──header timer──▶ headers complete: cancelled
                                                              ──timer fires first: closed
    the transport's write buffer fills (the client stopped reading) ──write timer──▶
        the buffer drains below the low-water mark: cancelled ──fires first: aborted

uvicorn closes an idle keep-alive connection, but a connection that opens and never finishes
its request headers (or never sends a byte) stays open for ever, and a client that stops reading
keeps its socket, its buffered response and its place in `limit_concurrency` for ever (a close()
waits for the buffer to drain). Aborting drops the buffer and runs connection_lost, which tells
the app the client left (http.disconnect), so the request frees its admission slot.

The body has its own deadline in the app (Intake.read): it arrives after the headers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def guarded_h11(header_timeout_s: float, write_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class with these timeouts (uvicorn builds one instance per connection)."""

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                self._arm_header_timer()  # part of a request's headers: they have a deadline
            else:
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # The next request (if any) gets a fresh header deadline from its first byte; the
            # keep-alive timer covers the silence before it.
            self._cancel_header_timer()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout_s, self._write_expired)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_expired)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_expired(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.abort()  # nothing was asked yet: nobody to answer

        def _write_expired(self) -> None:
            self._write_timer = None
            self.transport.abort()  # even if closing: close() would wait for the reader

    return GuardedH11Protocol
