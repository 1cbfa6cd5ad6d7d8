"""The worker's side of the engine link: a DEALER socket owned by one I/O thread.

    gateway ROUTER ⇄ DEALER ─ I/O thread ─┬─▶ inbound queue ──▶ engine loop
                                          └─◀ inproc PULL ◀── PUSH (the loop's Outbound)

The engine loop never touches the DEALER and never waits on the network: it drains `inbound`
between steps and pushes encoded frames to an inproc socket that this thread forwards. The thread
also says Hello, sends heartbeats with the latest stats snapshot, and answers frames that do not
decode with a ProtocolError instead of dying.

Unwelcomed (before the first Welcome, or after a Reset from a restarted gateway) the thread has
one Hello outstanding at a time, sent again only after HELLO_RETRY_S without an answer, however
many Resets arrive; the engine's frames meanwhile belong to the old gateway's requests and are
dropped, not sent (each would earn another Reset). Sends never block: the DEALER queues nothing
for a connection that is not up (IMMEDIATE), and a frame it cannot take is dropped.

A Generate carries the time left to its deadline; it becomes a deadline on this host's clock
the moment it arrives, so the two hosts' clocks need not agree.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import replace
from typing import Any

import zmq

from protocol import codec
from protocol import messages as m
from protocol.transport import KeyPair, configure_dealer

log = logging.getLogger("kestrel.worker.link")

HELLO_RETRY_S = 3.0
HELLO_RETRY_UNSENT_S = 0.5  # the Hello could not leave (no connection yet): try again soon


def local_deadline(gen: m.Generate) -> m.Generate:
    """The Generate with `deadline` on this host's clock: now + the time it had left."""
    timeout = gen.timeout_s
    if timeout is None or not math.isfinite(timeout):
        return replace(gen, deadline=None)
    return replace(gen, deadline=time.time() + max(0.0, timeout))


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
    def __init__(self, address: str, hello: m.Hello, heartbeat_s: float,
                 keys: KeyPair | None = None, gateway_key: bytes | None = None) -> None:
        self.address = address
        self.hello = hello
        self.heartbeat_s = heartbeat_s
        self.keys = keys
        self.gateway_key = gateway_key
        self.inbound: queue.Queue[Any] = queue.Queue()
        # request id -> monotonic time its Cancel reached this thread (read by the engine loop,
        # which removes the entry when the request ends or when the Cancel finds it ended).
        self.cancel_arrivals: dict[str, float] = {}
        self.stats = m.Stats()  # replaced whole by the engine loop; a reference swap is atomic
        self.draining = False
        self.welcomed = threading.Event()
        self.rejected: str | None = None
        self._next_hello = 0.0  # monotonic time of the next Hello while unwelcomed
        self._ctx = zmq.Context()
        self._inproc = f"inproc://kestrel-out-{id(self)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._inproc)
        self._stop = threading.Event()
        self._dying: m.WorkerDying | None = None
        # Silences to announce (quiet()): each its length and the event set once it is sent
        self._quiet: queue.SimpleQueue[tuple[float, threading.Event]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kestrel-link", daemon=True)

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    def start(self) -> None:
        self._thread.start()

    def open_outbound(self) -> Outbound:
        return Outbound(self._ctx, self._inproc)

    def forget(self, request_id: str) -> None:
        """A request that ended with no frame to send (cancelled while its grammar was being
        built): with one gateway there is nothing to forget."""

    def reset_scope(self, msg: m.Reset, request_ids: list[str]) -> list[str]:
        """The requests a Reset ends: with one gateway, all of them."""
        return request_ids

    def quiet(self, seconds: float, wait_s: float = 1.0) -> None:
        """Tell the gateway now, in a heartbeat, that nothing may come from this worker for
        `seconds`, and wait (`wait_s` at most) until it is sent: the caller is about to run
        work that holds the GIL, through which this thread cannot send its heartbeats."""
        sent = threading.Event()
        self._quiet.put((seconds, sent))
        if self._thread.is_alive():
            sent.wait(wait_s)

    def stop(self, dying_reason: str | None = None, timeout: float = 2.0) -> None:
        """Flush what the engine pushed, optionally say WorkerDying, and close."""
        if dying_reason is not None:
            self._dying = m.WorkerDying(self.hello.worker_id, dying_reason)
        self._stop.set()
        if self._thread.ident is None:  # never started: its socket is closed here
            self._pull.close(linger=0)
            return
        self._thread.join(timeout)

    # ---- the I/O thread ---------------------------------------------------------------------

    def _run(self) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        configure_dealer(dealer, self.hello.worker_id, self.keys, self.gateway_key)
        dealer.connect(self.address)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                timeout_ms = max(0.0, min(next_beat - time.monotonic(), 0.1)) * 1000
                events = dict(poller.poll(timeout_ms))
                if self._pull in events:
                    self._forward(dealer)
                if dealer in events:
                    self._receive(dealer)
                now = time.monotonic()
                if not self.welcomed.is_set() and now >= self._next_hello:
                    sent = self._send(dealer, self.hello)
                    self._next_hello = now + (HELLO_RETRY_S if sent else HELLO_RETRY_UNSENT_S)
                quiet = None if self._quiet.empty() else self._quiet.get_nowait()
                if now >= next_beat or quiet is not None:
                    next_beat = now + self.heartbeat_s
                    if self.welcomed.is_set():  # else no gateway counts our silence yet
                        self._send(dealer, m.Heartbeat(self.hello.worker_id, self.stats,
                                                       time.time(), self.draining,
                                                       quiet[0] if quiet else 0.0))
                    if quiet is not None:
                        quiet[1].set()
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
            if self.welcomed.is_set():  # else: stale, for a gateway that no longer knows us
                self._send_frames(dealer, frames)

    def _send(self, dealer: zmq.Socket, msg: Any) -> bool:
        return self._send_frames(dealer, codec.encode(msg))

    def _send_frames(self, dealer: zmq.Socket, frames: list[bytes]) -> bool:
        try:
            dealer.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:  # no connection up, or the gateway stopped reading: drop it
            return False

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
            if msg.index is None:  # a per-choice cancel (n > 1 stop string) ends no request
                self.cancel_arrivals.setdefault(msg.request_id, time.monotonic())
            self.inbound.put(msg)
        elif isinstance(msg, m.Generate):
            self.inbound.put(local_deadline(msg))
        elif isinstance(msg, m.Reset):
            # A gateway that does not know us (it restarted): its requests are gone with it.
            # Only the first Reset counts; while unwelcomed, one Hello is outstanding at a time.
            if self.welcomed.is_set():
                log.warning("gateway asked for a new hello: %s", msg.reason)
                self.welcomed.clear()
                self.inbound.put(msg)
                self._next_hello = 0.0
        elif isinstance(msg, m.ProtocolError):
            log.warning("gateway could not decode a frame of ours: %s", msg.message)
        else:
            log.warning("ignored an unexpected %s from the gateway", type(msg).__name__)
