"""Who is a worker on the engine link: joining, and being noticed gone.

    a Hello from a new (or known) peer ──a task of its own (gateway.engine.hello: decode, check,
        tokenizer load in threads; the receive loop keeps reading meanwhile)──▶ registry.admit
        and a Welcome, or a refusal (logged once a minute per peer and reason)
    any other frame from an unknown peer ──▶ dropped undecoded, at most one Reset per peer per
        RESET_INTERVAL_S (a worker of a previous gateway life says Hello again)
    silent for heartbeat_timeout_s while the gateway listened (a time its own loop was held
        does not count, nor a silence it announced: Heartbeat.quiet_s, MAX_QUIET_S at most),
        or its connection closed (probed at each disconnect event)
        ──▶ on_lost(worker, reason): gateway.engine.engine_client fails or moves its requests
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway import offload
from gateway.engine.hello import Refused, vet_hello
from gateway.engine.link import LinkSurface
from gateway.engine.registry import Registry, WorkerState
from protocol import codec
from protocol import messages as m

log = logging.getLogger("kestrel.gateway.engine")

RESET_INTERVAL_S = 2.0  # at most one Reset per unknown peer per interval
MAX_PENDING_HELLOS = 8  # Hellos being checked at once; more are dropped (the worker retries)
REFUSAL_LOG_S = 60.0  # one log line per refused peer and reason this often; the rest counted


class Membership:
    def __init__(self, link: LinkSurface, registry: Registry, heartbeat_timeout_s: float,
                 on_lost: Callable[[WorkerState, str], None]) -> None:
        self.link = link
        self.registry = registry
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_lost = on_lost
        self.hellos: dict[bytes, asyncio.Task] = {}  # identity -> its Hello being checked
        self._last_reset: dict[bytes, float] = {}
        # (who, reason) -> (when last logged, refusals since): a peer retrying its Hello every
        # second must not fill the log
        self._refusals: dict[tuple[str, str], tuple[float, int]] = {}
        self._said_unjoined = -3600.0  # when a closed connection that was no worker's was logged
        # Peers dropped for frames no honest worker sends: identity -> until when its Hellos
        # are refused unread (a dropped rogue that says Hello again costs a tokenizer each time)
        self._banned: dict[bytes, float] = {}

    def ban(self, identity: bytes, seconds: float) -> None:
        now = time.monotonic()
        if len(self._banned) >= 4096:  # bounded: forget bans that ended
            self._banned = {k: t for k, t in self._banned.items() if t > now}
        self._banned[identity] = now + seconds

    def start_hello(self, identity: bytes, body: list[bytes]) -> None:
        if identity in self.hellos or len(self.hellos) >= MAX_PENDING_HELLOS:
            return  # one at a time per peer; the worker says Hello again if unanswered
        if self._banned.get(identity, 0.0) > time.monotonic():  # refused unread
            answer = self._refuse(identity, "(dropped)", "dropped for sending frames no honest "
                                  "worker sends; its Hellos are refused for a while")
        else:
            answer = self.on_hello(identity, body)
        task = asyncio.create_task(answer, name="engine-hello")
        self.hellos[identity] = task
        task.add_done_callback(lambda _t: self.hellos.pop(identity, None))

    async def on_hello(self, identity: bytes, body: list[bytes]) -> None:
        if identity in self.registry.workers:  # a repeated Hello: answer it again, unread
            await self.link.send(identity, m.Welcome(m.PROTOCOL_VERSION, True))
            return
        try:
            vetted = await vet_hello(self.registry, body)
        except offload.Busy:  # vetting is full: the worker says Hello again in a second
            log.debug("Hello from a peer left for later: vetting is busy")
            return
        except codec.DecodeError as exc:
            log.warning("dropped a Hello that did not decode: %s", exc)
            await self.link.send(identity, m.ProtocolError(f"gateway could not decode: {exc}"))
            return
        if isinstance(vetted, Refused):
            await self._refuse(identity, vetted.who, vetted.reason)
            return
        hello = vetted.hello
        worker = self.registry.admit(identity, hello, vetted.digest, vetted.tokenizer)
        self._last_reset.pop(identity, None)
        if not await self.link.send(identity, m.Welcome(m.PROTOCOL_VERSION, True)):
            # It left while its Hello was vetted (a send to a gone peer fails at once): never
            # count it as ready, not even until its heartbeats are missed.
            self.on_lost(worker, "it left before its Hello was answered")
            return
        log.info("worker %s ready: model %s, max_model_len %d, KV %d tokens", worker.name,
                 hello.model_id, hello.max_model_len, hello.kv_capacity_tokens)

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
        await self.link.send(identity, m.Welcome(m.PROTOCOL_VERSION, False, reason))

    async def reset(self, identity: bytes) -> None:
        """Ask an unknown peer (a worker of a previous gateway life) for a Hello, rarely."""
        now = time.monotonic()
        if now - self._last_reset.get(identity, -RESET_INTERVAL_S) < RESET_INTERVAL_S:
            return
        if len(self._last_reset) > 4096:  # bounded: forget peers not reset recently
            self._last_reset = {k: t for k, t in self._last_reset.items()
                                if now - t < RESET_INTERVAL_S}
        self._last_reset[identity] = now
        await self.link.send(identity, m.Reset("unknown worker: say hello"))

    async def disconnect_loop(self) -> None:
        """A peer's connection closed: find out whether it was a worker, and drop it now."""
        while True:
            await self.link.next_disconnect()
            # The event does not say which peer. With ROUTER_MANDATORY a send to a peer whose
            # connection is gone fails at once, so probe each worker with a harmless frame (a
            # repeated Welcome). Probe twice: the socket may take a moment to retire the pipe.
            lost = 0
            for _ in range(2):
                for worker in [w for w in self.registry.workers.values() if w.ready]:
                    probe = m.Welcome(m.PROTOCOL_VERSION, True)
                    if not await self.link.send(worker.identity, probe):
                        self.on_lost(worker, "its connection closed")
                        lost += 1
                await asyncio.sleep(0.1)
            now = time.monotonic()
            if not lost and now - self._said_unjoined > 60:  # at most once a minute
                self._said_unjoined = now
                log.info("a connection to the engine link closed that was no worker's: a peer "
                         "that went before its Hello was answered, or one whose frame was over "
                         "the link's %d MiB limit (libzmq closes those unread; a worker whose "
                         "Hello is too big says so in its own log)", codec.MAX_FRAME_BYTES >> 20)

    async def liveness_loop(self) -> None:
        interval = self.heartbeat_timeout_s / 10  # detected within 1.1x the timeout
        while True:
            before = time.monotonic()
            await asyncio.sleep(interval)
            now = time.monotonic()
            deaf = now - before - interval
            if deaf > interval:
                # The gateway's own loop was held (a thread holding the GIL, a long callback):
                # the heartbeats of that time wait unread in the socket. A silence the gateway
                # could not hear does not count; judge again once the receive loop has read.
                for worker in self.registry.workers.values():
                    worker.last_seen = min(now, worker.last_seen + deaf)
                continue
            for worker in list(self.registry.workers.values()):
                if worker.ready and worker.silent_for(now) > self.heartbeat_timeout_s:
                    self.on_lost(worker, f"silent for {now - worker.last_seen:.1f} s")
