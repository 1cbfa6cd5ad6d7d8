"""The engine link's socket: one ZeroMQ ROUTER that workers connect to, and nothing else.

    bind: ZAP authenticator (CURVE allow-list) running ──before──▶ bind the ROUTER, watch its
        disconnect events
    recv() ──▶ (identity, frames)          send(identity, msg) ──encode──▶ the peer, or False
    next_disconnect() ──▶ returns when some peer's connection closed (not which one)

What the frames mean, and who the peers are, is gateway.engine.engine_client's and
gateway.engine.membership's. What they drive of the link is `LinkSurface`, met by EngineLink
and by the tests' in-memory link (tests/gateway/fake_engine.py), and checked against both in
tests/gateway/engine/test_link_surface.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from protocol import codec
from protocol.transport import KeyPair, configure_router, is_loopback

log = logging.getLogger("kestrel.gateway.engine")


class LinkSurface(Protocol):
    """The engine link as the engine client and the membership drive it."""

    def bind(self) -> None:
        """Start listening (before the first recv)."""
        ...

    def close(self) -> None:
        """Stop; idempotent, also for a link never bound."""
        ...

    async def recv(self) -> tuple[bytes, list[bytes]]:
        """The next message: its sender's identity and its frames."""
        ...

    async def send(self, identity: bytes, msg: Any) -> bool:
        """`msg` to the peer `identity`; False if it could not go (the peer gone or full)."""
        ...

    async def next_disconnect(self) -> None:
        """Return when some peer's connection closed (not which one)."""
        ...


class EngineLink:
    def __init__(self, address: str, keys: KeyPair | None = None,
                 authorized_keys: str | None = None,
                 name_of: Callable[[bytes], str] = lambda _identity: "(unknown)") -> None:
        self.address = address
        self.keys = keys
        self.authorized_keys = authorized_keys
        self.name_of = name_of  # a peer's name for the log (the registry's opaque "w<n>")
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._auth: AsyncioAuthenticator | None = None

    def bind(self) -> None:
        if self.keys is not None:
            # The authenticator must run before bind: a CURVE server without one accepts any
            # client that knows its public key.
            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=self.authorized_keys)
        elif self.address.startswith("tcp://"):
            where = "this host" if is_loopback(self.address) else "the network"
            log.warning("the engine link binds %s without CURVE keys (--insecure-link): any "
                        "process on %s that reaches it can join as a worker, read prompts and "
                        "write answers (pass --link-secret-key and --link-authorized-keys)",
                        self.address, where)
        self._sock = self._ctx.socket(zmq.ROUTER)
        configure_router(self._sock, self.keys)
        self._sock.bind(self.address)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        log.info("engine link bound at %s (CURVE %s)", self.address,
                 "on" if self.keys else "off")

    def close(self) -> None:
        """Idempotent; also for a link that was never bound."""
        if self._sock is not None:
            self._sock.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()

    async def recv(self) -> tuple[bytes, list[bytes]]:
        assert self._sock is not None
        frames = await self._sock.recv_multipart(copy=True)
        return frames[0], frames[1:]

    async def send(self, identity: bytes, msg: Any) -> bool:
        assert self._sock is not None
        try:
            await self._sock.send_multipart([identity, *codec.encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone; EAGAIN: it stopped reading
            log.warning("could not send %s to worker %s: %s", type(msg).__name__,
                        self.name_of(identity), exc)
            return False

    async def next_disconnect(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                return
