"""The worker's side of the engine link: a DEALER socket owned by one I/O thread.

    gateway ROUTER ⇄ DEALER ─ I/O thread ─┬─▶ inbound queue ──▶ engine loop
                                          └─◀ inproc PULL ◀── PUSH (the loop's Outbound)

The engine loop never touches the DEALER and never waits on the network: it drains `inbound`
between steps and pushes encoded frames to an inproc socket that this thread forwards. The thread
also says Hello, sends heartbeats with the latest stats snapshot, and answers frames that do not
decode with a ProtocolError instead of dying.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import replace
from typing import Any

import zmq

from protocol import codec
from protocol import messages as m
from protocol.transport import configure_dealer

log = logging.getLogger("kestrel.worker.link")

HELLO_RETRY_S = 3.0


class Outbound:
    """The engine loop's way out: an inproc PUSH socket, used only by the thread that made it."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)

    def send(self, msg: Any) -> None:
        self._sock.send_multipart(codec.encode(msg))

    def close(self) -> None:
        self._sock.close()


class WorkerLink:
    def __init__(self, address: str, hello: m.Hello, heartbeat_s: float) -> None:
        self.address = address
        self.hello = hello
        self.heartbeat_s = heartbeat_s
        self.inbound: queue.Queue[Any] = queue.Queue()
        # request id -> monotonic time its Cancel reached this thread (read by the engine loop).
        self.cancel_arrivals: dict[str, float] = {}
        self.stats = m.Stats()  # replaced whole by the engine loop; a reference swap is atomic
        self.draining = False
        self.welcomed = threading.Event()
        self.rejected: str | None = None
        self._ctx = zmq.Context()
        self._inproc = f"inproc://kestrel-out-{id(self)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._inproc)
        self._stop = threading.Event()
        self._dying: m.WorkerDying | None = None
        self._thread = threading.Thread(target=self._run, name="kestrel-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def open_outbound(self) -> Outbound:
        return Outbound(self._ctx, self._inproc)

    def stop(self, dying_reason: str | None = None, timeout: float = 2.0) -> None:
        """Flush what the engine pushed, optionally say WorkerDying, and close."""
        if dying_reason is not None:
            self._dying = m.WorkerDying(self.hello.worker_id, dying_reason)
        self._stop.set()
        self._thread.join(timeout)

    # ---- the I/O thread ---------------------------------------------------------------------

    def _run(self) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        configure_dealer(dealer, self.hello.worker_id)
        dealer.connect(self.address)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        self._send(dealer, self.hello)
        last_hello = next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                timeout_ms = max(0.0, min(next_beat - time.monotonic(), 0.1)) * 1000
                events = dict(poller.poll(timeout_ms))
                if self._pull in events:
                    self._forward(dealer)
                if dealer in events:
                    self._receive(dealer)
                now = time.monotonic()
                if not self.welcomed.is_set() and now - last_hello > HELLO_RETRY_S:
                    self._send(dealer, self.hello)  # the gateway may not have been up yet
                    last_hello = now
                if now >= next_beat:
                    next_beat = now + self.heartbeat_s
                    if self.welcomed.is_set():
                        self._send(dealer, m.Heartbeat(self.hello.worker_id, self.stats,
                                                       time.time(), self.draining))
            self._forward(dealer)
            if self._dying is not None:
                self._send(dealer, self._dying)
                time.sleep(0.05)  # let the frame leave before the socket closes
        finally:
            dealer.close(linger=500)
            self._pull.close()

    def _forward(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            dealer.send_multipart(frames)

    def _send(self, dealer: zmq.Socket, msg: Any) -> None:
        dealer.send_multipart(codec.encode(msg))

    def _receive(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = codec.decode(frames)
            except codec.DecodeError as exc:
                log.warning("dropped a frame from the gateway that did not decode: %s", exc)
                self._send(dealer, m.ProtocolError(f"worker could not decode a frame: {exc}"))
                continue
            self._dispatch(dealer, msg)

    def _dispatch(self, dealer: zmq.Socket, msg: Any) -> None:
        if isinstance(msg, m.Welcome):
            if msg.accepted:
                log.info("gateway accepted this worker (protocol %d)", msg.protocol_version)
                self.welcomed.set()
            else:
                self.rejected = msg.reason
                log.error("gateway refused this worker: %s", msg.reason)
                self.inbound.put(msg)
        elif isinstance(msg, m.Cancel):
            self.cancel_arrivals.setdefault(msg.request_id, time.monotonic())
            self.inbound.put(msg)
        elif isinstance(msg, m.Generate):
            self.inbound.put(msg)
        elif isinstance(msg, m.Reset):
            # A gateway that does not know us (it restarted): its requests are gone with it.
            log.warning("gateway asked for a new hello: %s", msg.reason)
            self.welcomed.clear()
            self.inbound.put(msg)
            self._send(dealer, replace(self.hello))
        elif isinstance(msg, m.ProtocolError):
            log.warning("gateway could not decode a frame of ours: %s", msg.message)
        else:
            log.warning("ignored an unexpected %s from the gateway", type(msg).__name__)
