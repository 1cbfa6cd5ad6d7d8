"""The gateway's side of the engine link: one ROUTER, any number of workers.

    worker DEALER ──Hello──▶ ROUTER ──▶ _on_hello: version check, tokenizer, Welcome
    worker DEALER ──TokenOutput/RequestError──▶ the owning request's queue (RequestHandle)
    handler ──submit()──▶ least-loaded ready worker for the model ──Generate──▶ worker
    handler ──cancel()──▶ the worker that owns the request ──Cancel──▶ worker
    liveness task: a worker silent for heartbeat_timeout_s, or one that says WorkerDying, is
    dropped and each of its requests gets a WorkerLost event, so nothing waits forever.
    disconnect task: a worker that dies without a word (kill -9, OOM) closes its TCP connection;
    the socket monitor reports it and a probe finds which worker is gone, within milliseconds
    instead of a heartbeat timeout.

Every frame is decoded by protocol.codec; one that does not decode is logged and answered with a
ProtocolError, never raised into the receive loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.tokenizer import GatewayTokenizer
from protocol import codec
from protocol import messages as m
from protocol.transport import configure_router

log = logging.getLogger("kestrel.gateway.engine")


class NoWorkerError(RuntimeError):
    """No ready worker serves the model."""


@dataclass(frozen=True)
class WorkerLost:
    """Event put on a request's queue when its worker died or went silent."""

    reason: str


@dataclass(frozen=True)
class Stopping:
    """Event put on every request's queue when the gateway's drain timeout passes."""

    reason: str


@dataclass
class WorkerState:
    identity: bytes
    hello: m.Hello
    last_seen: float
    stats: m.Stats = field(default_factory=m.Stats)
    inflight: set[str] = field(default_factory=set)
    ready: bool = False
    draining: bool = False

    @property
    def name(self) -> str:
        return self.hello.worker_id[:8]


@dataclass
class ModelEntry:
    """A model some worker serves, with the tokenizer built from that worker's Hello."""

    model_id: str
    hello: m.Hello
    tokenizer: GatewayTokenizer
    created: int = field(default_factory=lambda: int(time.time()))


class RequestHandle:
    def __init__(self, request_id: str, worker: WorkerState) -> None:
        self.request_id = request_id
        self.worker = worker
        self.events: asyncio.Queue[m.TokenOutput | m.RequestError | WorkerLost | Stopping] = \
            asyncio.Queue()
        self.closed = False


_ids = itertools.count()


def new_request_id() -> str:
    # Unique across workers and gateway restarts: random prefix plus a counter.
    return f"{uuid.uuid4().hex[:12]}-{next(_ids)}"


class EngineClient:
    def __init__(self, address: str, heartbeat_timeout_s: float = 1.5) -> None:
        self.address = address
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.workers: dict[bytes, WorkerState] = {}
        self.models: dict[str, ModelEntry] = {}
        self.requests: dict[str, RequestHandle] = {}
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self.on_stats: list[Any] = []  # callbacks(worker, stats), for metrics

    async def start(self) -> None:
        self._sock = self._ctx.socket(zmq.ROUTER)
        configure_router(self._sock)
        self._sock.bind(self.address)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.create_task(self._receive_loop(), name="engine-receive"),
                       asyncio.create_task(self._liveness_loop(), name="engine-liveness"),
                       asyncio.create_task(self._disconnect_loop(), name="engine-disconnects")]
        log.info("engine link bound at %s", self.address)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
            self._sock.close(linger=0)
        self._ctx.term()

    # ---- for the HTTP layer -----------------------------------------------------------------

    def ready_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.ready and not w.draining]

    @property
    def ready(self) -> bool:
        return bool(self.ready_workers())

    def capacity(self) -> int:
        """Sequences the ready workers can run at once: the default admission limit."""
        return sum(w.hello.max_num_seqs for w in self.ready_workers())

    def serves(self, model_id: str) -> bool:
        """Whether a ready (not draining) worker serves the model right now."""
        return any(w.hello.model_id == model_id for w in self.ready_workers())

    def model(self, model_id: str) -> ModelEntry | None:
        return self.models.get(model_id)

    async def submit(self, model_id: str, gen: m.Generate) -> RequestHandle:
        candidates = [w for w in self.ready_workers() if w.hello.model_id == model_id]
        if not candidates:
            raise NoWorkerError(f"no ready worker serves {model_id!r}")
        worker = min(candidates, key=lambda w: len(w.inflight))
        handle = RequestHandle(gen.request_id, worker)
        self.requests[gen.request_id] = handle
        worker.inflight.add(gen.request_id)
        if not await self._send(worker.identity, gen):
            self._drop_worker(worker, "unreachable")
        return handle

    async def cancel(self, handle: RequestHandle) -> None:
        """Forget the request here and tell its worker to stop it. Idempotent."""
        if handle.closed:
            return
        self.release(handle)
        if handle.worker.identity in self.workers:
            await self._send(handle.worker.identity, m.Cancel(handle.request_id))

    async def cancel_choice(self, handle: RequestHandle, index: int) -> None:
        """Tell the worker to stop one choice of a request that goes on (n > 1)."""
        if not handle.closed and handle.worker.identity in self.workers:
            await self._send(handle.worker.identity, m.Cancel(handle.request_id, index))

    def fail_all(self, reason: str) -> None:
        """End every request in flight (the drain timeout passed): each gets a Stopping event,
        and its Generation's close() then cancels it at its worker."""
        for handle in list(self.requests.values()):
            handle.events.put_nowait(Stopping(reason))

    def release(self, handle: RequestHandle) -> None:
        """The request is over (finished, failed or cancelled): stop routing frames to it."""
        handle.closed = True
        self.requests.pop(handle.request_id, None)
        handle.worker.inflight.discard(handle.request_id)

    # ---- the link ---------------------------------------------------------------------------

    async def _send(self, identity: bytes, msg: Any) -> bool:
        assert self._sock is not None
        try:
            await self._sock.send_multipart([identity, *codec.encode(msg)])
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone
            log.warning("could not send %s to worker %s: %s", type(msg).__name__,
                        identity[:8].decode(errors="replace"), exc)
            return False

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                identity, body = frames[0], frames[1:]
                await self._dispatch(identity, body)
            except Exception:  # one bad frame or bug must not stop the link
                log.exception("error while handling a frame from a worker")

    async def _dispatch(self, identity: bytes, body: list[bytes]) -> None:
        try:
            msg = codec.decode(body)
        except codec.DecodeError as exc:
            log.warning("dropped a frame from %r that did not decode: %s", identity[:16], exc)
            await self._send(identity, m.ProtocolError(f"gateway could not decode: {exc}"))
            return
        worker = self.workers.get(identity)
        if worker is not None:
            worker.last_seen = time.monotonic()
        if isinstance(msg, m.Hello):
            await self._on_hello(identity, msg)
        elif worker is None:
            if not isinstance(msg, (m.ProtocolError, m.WorkerDying)):
                # A worker that joined a previous life of this gateway: ask it to say Hello.
                await self._send(identity, m.Reset("unknown worker: say hello"))
        elif isinstance(msg, (m.TokenOutput, m.RequestError)):
            handle = self.requests.get(msg.request_id)
            if handle is not None and handle.worker is worker:
                handle.events.put_nowait(msg)
        elif isinstance(msg, m.Heartbeat):
            worker.stats = msg.stats
            worker.draining = msg.draining
            for callback in self.on_stats:
                callback(worker, msg.stats)
        elif isinstance(msg, m.WorkerDying):
            log.warning("worker %s is going away: %s", worker.name, msg.reason)
            self._drop_worker(worker, f"worker exited: {msg.reason}")
        elif isinstance(msg, m.ProtocolError):
            log.warning("worker %s could not decode a frame of ours: %s", worker.name, msg.message)

    async def _on_hello(self, identity: bytes, hello: m.Hello) -> None:
        if hello.protocol_version != m.PROTOCOL_VERSION:
            reason = (f"protocol version mismatch: worker speaks {hello.protocol_version}, "
                      f"gateway speaks {m.PROTOCOL_VERSION}")
            log.error("refused worker %s: %s", hello.worker_id[:8], reason)
            await self._send(identity, m.Welcome(m.PROTOCOL_VERSION, False, reason))
            return
        known = self.workers.get(identity)
        if known is not None and known.ready:  # a repeated Hello: answer it again
            await self._send(identity, m.Welcome(m.PROTOCOL_VERSION, True))
            return
        worker = WorkerState(identity, hello, time.monotonic())
        self.workers[identity] = worker
        if hello.model_id not in self.models:
            try:
                tokenizer = await asyncio.to_thread(GatewayTokenizer.from_info, hello.tokenizer)
            except Exception as exc:
                log.exception("worker %s sent a tokenizer that does not load", worker.name)
                reason = f"tokenizer did not load: {exc}"
                await self._send(identity, m.Welcome(m.PROTOCOL_VERSION, False, reason))
                self.workers.pop(identity, None)
                return
            self.models[hello.model_id] = ModelEntry(hello.model_id, hello, tokenizer)
        if identity not in self.workers:  # dropped while the tokenizer loaded
            return
        worker.ready = True
        worker.last_seen = time.monotonic()  # heartbeats start only after the Welcome
        await self._send(identity, m.Welcome(m.PROTOCOL_VERSION, True))
        log.info("worker %s ready: model %s, max_model_len %d, KV %d tokens", worker.name,
                 hello.model_id, hello.max_model_len, hello.kv_capacity_tokens)

    def _drop_worker(self, worker: WorkerState, reason: str) -> None:
        if self.workers.get(worker.identity) is not worker:
            return
        del self.workers[worker.identity]
        for rid in list(worker.inflight):
            handle = self.requests.get(rid)
            if handle is not None:
                handle.events.put_nowait(WorkerLost(reason))
        log.warning("worker %s dropped (%s); failed %d requests", worker.name, reason,
                    len(worker.inflight))
        worker.inflight.clear()
        served = {w.hello.model_id for w in self.workers.values()}
        for model_id in list(self.models):
            if model_id not in served:
                del self.models[model_id]

    async def _disconnect_loop(self) -> None:
        """A peer's connection closed: find out whether it was a worker, and drop it now."""
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            # The event does not say which peer. With ROUTER_MANDATORY a send to a peer whose
            # connection is gone fails at once, so probe each worker with a harmless frame (a
            # repeated Welcome). Probe twice: the socket may take a moment to retire the pipe.
            for _ in range(2):
                for worker in [w for w in self.workers.values() if w.ready]:
                    if not await self._send(worker.identity, m.Welcome(m.PROTOCOL_VERSION, True)):
                        self._drop_worker(worker, "its connection closed")
                await asyncio.sleep(0.1)

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_timeout_s / 10)  # detected within 1.1x the timeout
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if worker.ready and now - worker.last_seen > self.heartbeat_timeout_s:
                    self._drop_worker(worker, f"silent for {now - worker.last_seen:.1f} s")
