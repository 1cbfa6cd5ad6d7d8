"""The gateway's side of the engine link: one ROUTER socket, any number of workers.

    start: ZAP authenticator (CURVE allow-list) running ──before──▶ bind the ROUTER
    frame from a known worker ──(any frame: proof of life)──▶ decode ──▶ _dispatch
    frame from an unknown peer: Hello ──▶ a task of its own (decode, check, tokenizer load in
        threads; the receive loop keeps reading heartbeats meanwhile) ──▶ Welcome or refusal;
        anything else ──▶ dropped undecoded, at most one Reset per peer per RESET_INTERVAL_S
    handler ──submit()──▶ registry.candidates (model, context fits) ──router.pick──▶ Generate
    handler ──cancel()──▶ the worker that owns the request ──Cancel──▶ worker
    lost worker (silent for heartbeat_timeout_s, WorkerDying, or its connection closed, which
        the socket monitor reports at once): requests that got no token yet are sent once to
        another worker; the others get a WorkerLost event, so nothing waits forever.

Workers and models live in gateway.registry; the routing policy in gateway.router. A frame that
does not decode is logged and answered with a ProtocolError, never raised into the receive loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from gateway.config import GatewayConfig
from gateway.hello import Refused, vet_hello
from gateway.registry import ModelEntry, Registry, WorkerState
from gateway.request_handle import (
    NoWorkerError,
    RequestHandle,
    Stopping,
    WorkerLost,
    new_request_id,
)
from gateway.router import Router
from protocol import codec
from protocol import messages as m
from protocol.transport import KeyPair, configure_router, is_loopback, load_secret_key

__all__ = ["EngineClient", "ModelEntry", "NoWorkerError", "RequestHandle", "Stopping",
           "WorkerLost", "WorkerState", "new_request_id"]

log = logging.getLogger("kestrel.gateway.engine")

RESET_INTERVAL_S = 2.0  # at most one Reset per unknown peer per interval
MAX_PENDING_HELLOS = 8  # Hellos being checked at once; more are dropped (the worker retries)
REFUSAL_LOG_S = 60.0  # one log line per refused peer and reason this often; the rest counted
FINISH_REASONS = frozenset({"stop", "length", "abort", "timeout"})


class EngineClient:
    def __init__(self, address: str, heartbeat_timeout_s: float = 1.5,
                 keys: KeyPair | None = None, authorized_keys: str | None = None,
                 routing: str = "cache_aware") -> None:
        self.address = address
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.keys = keys
        self.authorized_keys = authorized_keys
        self.registry = Registry()
        self.router = Router(routing)
        self.requests: dict[str, RequestHandle] = {}
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._tasks: list[asyncio.Task] = []
        self._hellos: dict[bytes, asyncio.Task] = {}  # identity -> its Hello being checked
        self._last_reset: dict[bytes, float] = {}
        # (who, reason) -> (when last logged, refusals since): a peer retrying its Hello every
        # second must not fill the log
        self._refusals: dict[tuple[str, str], tuple[float, int]] = {}
        self.on_stats: list[Any] = []  # callbacks(worker, stats), for metrics

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> EngineClient:
        keys = load_secret_key(cfg.link_secret_key) if cfg.link_secret_key else None
        return cls(cfg.engine_address, cfg.heartbeat_timeout_s, keys,
                   cfg.link_authorized_keys or None, cfg.routing)

    @property
    def workers(self) -> dict[bytes, WorkerState]:
        return self.registry.workers

    @property
    def models(self) -> dict[str, ModelEntry]:
        return self.registry.models

    async def start(self) -> None:
        if self.keys is not None:
            # The authenticator must run before bind: a CURVE server without one accepts any
            # client that knows its public key.
            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=self.authorized_keys)
        elif not is_loopback(self.address):
            log.warning("the engine link binds %s without CURVE keys: anyone who reaches it can "
                        "join as a worker (pass --link-secret-key and --link-authorized-keys)",
                        self.address)
        self._sock = self._ctx.socket(zmq.ROUTER)
        configure_router(self._sock, self.keys)
        self._sock.bind(self.address)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.create_task(self._receive_loop(), name="engine-receive"),
                       asyncio.create_task(self._liveness_loop(), name="engine-liveness"),
                       asyncio.create_task(self._disconnect_loop(), name="engine-disconnects")]
        log.info("engine link bound at %s (CURVE %s)", self.address,
                 "on" if self.keys else "off")

    async def close(self) -> None:
        for task in [*self._tasks, *self._hellos.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._hellos.values(), return_exceptions=True)
        if self._sock is not None:
            self._sock.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
            self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ---- for the HTTP layer -----------------------------------------------------------------

    def ready_workers(self) -> list[WorkerState]:
        return self.registry.ready_workers()

    @property
    def ready(self) -> bool:
        return bool(self.ready_workers())

    def capacity(self) -> int:
        """Sequences the ready workers can run at once: the default admission limit."""
        return sum(w.capacity for w in self.ready_workers())

    def ready_worker_ids(self) -> list[str]:
        return [w.hello.worker_id for w in self.ready_workers()]

    def load(self, model_id: str) -> list[tuple[str, int]]:
        """(worker id, sequences it runs for us now) for the ready workers of the model: our
        own count (each request's n), not the heartbeat's, which may be a second old."""
        reqs = self.requests
        return [(w.hello.worker_id, sum(reqs[r].gen.params.n for r in w.inflight if r in reqs))
                for w in self.registry.candidates(model_id)]

    def serves(self, model_id: str) -> bool:
        """Whether a ready (not draining) worker serves the model right now."""
        return bool(self.registry.candidates(model_id))

    def model(self, name: str) -> ModelEntry | None:
        """The model with this id, or with this alias (--served-model-name's later names)."""
        models = self.registry.models
        entry = models.get(name)
        if entry is None:
            entry = next((e for e in models.values() if name in e.hello.aliases), None)
        return entry

    async def submit(self, model_id: str, gen: m.Generate,
                     deadline: float | None = None) -> RequestHandle:
        """Send to the router's pick among the workers whose context fits; `deadline` is
        monotonic, and each send carries the time then left (gen.timeout_s)."""
        need = len(gen.prompt_token_ids) + gen.params.max_tokens
        candidates = self.registry.candidates(model_id, need)
        if not candidates:
            raise NoWorkerError(f"no ready worker serves {model_id!r} with a context of "
                                f"{need} tokens")
        worker = self.router.pick(candidates, gen.prompt_token_ids, gen.cache_salt)
        handle = RequestHandle(gen, worker, deadline)
        self.requests[gen.request_id] = handle
        await self._send_generate(handle, worker)
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

    # ---- sending ----------------------------------------------------------------------------

    async def _send_generate(self, handle: RequestHandle, worker: WorkerState) -> None:
        handle.worker = worker
        worker.inflight.add(handle.request_id)
        gen = replace(handle.gen, timeout_s=handle.remaining(), deadline=None)
        if not await self._send(worker.identity, gen):
            self._drop_worker(worker, "unreachable")

    async def _send(self, identity: bytes, msg: Any) -> bool:
        assert self._sock is not None
        try:
            await self._sock.send_multipart([identity, *codec.encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone; EAGAIN: it stopped reading
            worker = self.workers.get(identity)
            log.warning("could not send %s to worker %s: %s", type(msg).__name__,
                        worker.name if worker else "(unknown)", exc)
            return False

    async def _reset(self, identity: bytes) -> None:
        """Ask an unknown peer (a worker of a previous gateway life) for a Hello, rarely."""
        now = time.monotonic()
        if now - self._last_reset.get(identity, -RESET_INTERVAL_S) < RESET_INTERVAL_S:
            return
        if len(self._last_reset) > 4096:  # bounded: forget peers not reset recently
            self._last_reset = {k: t for k, t in self._last_reset.items()
                                if now - t < RESET_INTERVAL_S}
        self._last_reset[identity] = now
        await self._send(identity, m.Reset("unknown worker: say hello"))

    # ---- receiving --------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            try:
                await self._on_frames(frames[0], frames[1:])
            except Exception:  # one bad frame or bug must not stop the link
                log.exception("error while handling a frame from a worker")

    async def _on_frames(self, identity: bytes, body: list[bytes]) -> None:
        worker = self.workers.get(identity)
        kind = codec.peek_type(body)
        if worker is None:
            if kind is m.Hello:
                self._start_hello(identity, body)
            elif kind is not None and kind is not m.WorkerDying:
                await self._reset(identity)  # never decoded: unknown peers get no CPU
            return
        worker.last_seen = time.monotonic()  # any frame is proof of life
        if kind is m.Hello:
            self._start_hello(identity, body)  # a repeated Hello: answered off the loop too
            return
        try:
            msg = codec.decode(body)  # small: codec limits non-Hello payloads to 64 KiB
        except codec.DecodeError as exc:
            log.warning("dropped a frame from worker %s that did not decode: %s", worker.name, exc)
            await self._send(identity, m.ProtocolError(f"gateway could not decode: {exc}"))
            return
        await self._dispatch(worker, msg)

    async def _dispatch(self, worker: WorkerState, msg: Any) -> None:
        if isinstance(msg, (m.TokenOutput, m.RequestError)):
            handle = self.requests.get(msg.request_id)
            if handle is None or handle.worker is not worker:
                return
            handle.answered = True
            if isinstance(msg, m.TokenOutput) and msg.finish_reason not in (None, *FINISH_REASONS):
                msg = replace(msg, finish_reason="abort")  # it becomes a metric label: bounded
            elif isinstance(msg, m.RequestError):
                msg = replace(msg, message=msg.message[:1000], code=msg.code[:64])
            handle.events.put_nowait(msg)
        elif isinstance(msg, m.Heartbeat):
            worker.stats = msg.stats
            worker.draining = msg.draining
            for callback in self.on_stats:
                callback(worker, msg.stats)
        elif isinstance(msg, m.WorkerDying):
            log.warning("worker %s is going away: %s", worker.name, msg.reason[:200])
            self._drop_worker(worker, "worker exited")
        elif isinstance(msg, m.ProtocolError):
            log.warning("worker %s could not decode a frame of ours: %s", worker.name,
                        msg.message[:200])

    def _start_hello(self, identity: bytes, body: list[bytes]) -> None:
        if identity in self._hellos or len(self._hellos) >= MAX_PENDING_HELLOS:
            return  # one at a time per peer; the worker says Hello again if unanswered
        task = asyncio.create_task(self._on_hello(identity, body), name="engine-hello")
        self._hellos[identity] = task
        task.add_done_callback(lambda _t: self._hellos.pop(identity, None))

    async def _refuse(self, identity: bytes, who: str, reason: str) -> None:
        now, key = time.monotonic(), (who, reason)
        last = self._refusals.get(key)
        if last is None or now - last[0] >= REFUSAL_LOG_S:
            more = f" ({last[1]} more refused since)" if last and last[1] else ""
            log.warning("refused worker %s: %s%s", who, reason[:300], more)
            if len(self._refusals) >= 1024:  # bounded: a flood of distinct reasons
                self._refusals.clear()
            self._refusals[key] = (now, 0)
        else:
            self._refusals[key] = (last[0], last[1] + 1)
        await self._send(identity, m.Welcome(m.PROTOCOL_VERSION, False, reason))

    async def _on_hello(self, identity: bytes, body: list[bytes]) -> None:
        if identity in self.workers:  # a repeated Hello: answer it again, unread
            await self._send(identity, m.Welcome(m.PROTOCOL_VERSION, True))
            return
        try:
            vetted = await vet_hello(self.registry, body)
        except codec.DecodeError as exc:
            log.warning("dropped a Hello that did not decode: %s", exc)
            await self._send(identity, m.ProtocolError(f"gateway could not decode: {exc}"))
            return
        if isinstance(vetted, Refused):
            await self._refuse(identity, vetted.who, vetted.reason)
            return
        hello = vetted.hello
        worker = self.registry.admit(identity, hello, vetted.digest, vetted.tokenizer)
        self._last_reset.pop(identity, None)
        await self._send(identity, m.Welcome(m.PROTOCOL_VERSION, True))
        log.info("worker %s ready: model %s, max_model_len %d, KV %d tokens", worker.name,
                 hello.model_id, hello.max_model_len, hello.kv_capacity_tokens)

    # ---- losing workers ---------------------------------------------------------------------

    def _drop_worker(self, worker: WorkerState, reason: str) -> None:
        if not self.registry.drop(worker):
            return
        self.router.forget(worker.identity)
        retried = failed = 0
        for rid in list(worker.inflight):
            handle = self.requests.get(rid)
            if handle is None or handle.closed:
                continue
            if not handle.answered and not handle.retried and self._retry(handle, worker):
                retried += 1
            else:
                failed += 1
                handle.events.put_nowait(WorkerLost(reason))
        log.warning("worker %s dropped (%s): %d requests failed, %d sent elsewhere",
                    worker.name, reason, failed, retried)
        worker.inflight.clear()

    def _retry(self, handle: RequestHandle, lost: WorkerState) -> bool:
        """Send a request that got nothing back yet to another worker, once."""
        need = len(handle.gen.prompt_token_ids) + handle.gen.params.max_tokens
        others = [w for w in self.registry.candidates(lost.hello.model_id, need) if w is not lost]
        if not others or handle.remaining() == 0.0:
            return False
        handle.retried = True
        target = self.router.pick(others, handle.gen.prompt_token_ids)
        task = asyncio.create_task(self._send_generate(handle, target), name="engine-retry")
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)
        return True

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
