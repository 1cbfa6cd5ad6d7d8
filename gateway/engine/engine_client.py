"""The gateway's side of the engine link: requests to workers and their answers back.

    handler ──submit()──▶ registry.candidates (model, context fits) ──router.pick──▶ Generate
    handler ──cancel()──▶ the worker that owns the request ──Cancel──▶ worker
    frame from a known worker ──(any frame: proof of life)──▶ decode ──▶ _dispatch: a step's
        token frames (StepOutputs) fanned out and errors, each to its request's queue;
        heartbeats to the worker's stats
    frame from an unknown peer ──▶ gateway.engine.membership (Hello, or a Reset)
    lost worker (gateway.engine.membership: silent, connection closed; or WorkerDying, or a
        send that failed): requests that got no token yet are sent once to another worker;
        the others get a WorkerLost event, so nothing waits forever.

The socket is gateway.engine.link; workers and models live in gateway.engine.registry; the routing
policy in gateway.engine.router. A frame that does not decode is logged and answered with a
ProtocolError, never raised into the receive loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
from dataclasses import replace
from typing import Any

from gateway.config import GatewayConfig
from gateway.engine.link import EngineLink, LinkSurface
from gateway.engine.membership import Membership
from gateway.engine.registry import ModelEntry, Registry, WorkerState
from gateway.engine.request_handle import (
    NoWorkerError,
    RequestHandle,
    Stopping,
    WorkerLost,
)
from gateway.engine.router import Router
from protocol import codec
from protocol import messages as m
from protocol.transport import KeyPair, load_secret_key

__all__ = ["EngineClient", "ModelEntry", "NoWorkerError", "RequestHandle", "Stopping",
           "WorkerLost", "WorkerState"]

log = logging.getLogger("kestrel.gateway.engine")

FINISH_REASONS = frozenset({"stop", "length", "abort", "timeout"})
# A worker that sends this many frames no honest worker sends (RequestHandle.refuse, empty
# StepOutputs) within FAULT_WINDOW_S is dropped: each one already ended its request with an
# error. (A window, not a life count: a model whose head is wider than its tokenizer may, very
# rarely, sample a padding id, and a worker that serves for months must not die of that.)
MAX_WORKER_FAULTS = 3
FAULT_WINDOW_S = 60.0
# The receive loop's turn: at most this many frames, or this long, before it lets the event loop
# run the rest (see _receive_loop). On a 2-vCPU Xeon, bench_gateway_ceiling.py --workers 1: a
# frame a turn 6,965 tokens/s; 32 frames or 2 ms ~36,000; 64 or 5 ms 44,900-51,900 (the loop's
# lag under that honest load ~35 ms, the streams' own work); a flooding worker's frames, for no
# stream, cost a turn at most 5 ms.
TURN_FRAMES = 64
TURN_S = 0.005


class EngineClient:
    def __init__(self, address: str, heartbeat_timeout_s: float = 1.5,
                 keys: KeyPair | None = None, authorized_keys: str | None = None,
                 routing: str = "cache_aware", link: LinkSurface | None = None) -> None:
        """`link`: the socket (default: a ZeroMQ EngineLink at `address`; tests pass their
        in-memory one)."""
        self.registry = Registry()
        self.router = Router(routing)
        self.requests: dict[str, RequestHandle] = {}
        self.link: LinkSurface = link if link is not None else \
            EngineLink(address, keys, authorized_keys, name_of=self._name_of)
        self.membership = Membership(self.link, self.registry, heartbeat_timeout_s,
                                     on_lost=self._drop_worker)
        self._tasks: list[asyncio.Task] = []
        self.turn_frames, self.turn_s = TURN_FRAMES, TURN_S
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

    def _name_of(self, identity: bytes) -> str:
        worker = self.workers.get(identity)
        return worker.name if worker else "(unknown)"

    async def start(self) -> None:
        self.link.bind()
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="engine-receive"),
            asyncio.create_task(self.membership.liveness_loop(), name="engine-liveness"),
            asyncio.create_task(self.membership.disconnect_loop(), name="engine-disconnects")]

    async def close(self) -> None:
        hellos = list(self.membership.hellos.values())
        for task in [*self._tasks, *hellos]:
            task.cancel()
        await asyncio.gather(*self._tasks, *hellos, return_exceptions=True)
        self.link.close()

    # ---- for the HTTP layer -----------------------------------------------------------------

    def ready_workers(self) -> list[WorkerState]:
        return self.registry.ready_workers()

    @property
    def ready(self) -> bool:
        return bool(self.ready_workers())

    def load(self, model_id: str) -> list[tuple[str, int]]:
        """(worker id, sequences it runs for us now) for the ready workers of the model: our
        own count (each request's n), not the heartbeat's, which may be a second old."""
        return [(w.hello.worker_id, w.sequences) for w in self.registry.candidates(model_id)]

    def serves(self, model_id: str) -> bool:
        """Whether a ready (not draining) worker serves the model right now."""
        return bool(self.registry.candidates(model_id))

    async def submit(self, model_id: str, gen: m.Generate,
                     deadline: float | None = None) -> RequestHandle:
        """Send to the router's pick among the workers whose context fits; `deadline` is
        monotonic, and each send carries the time then left (gen.timeout_s)."""
        # an embedding request's inputs are computed apart: the longest must fit
        need = (max(gen.input_lengths) if gen.embed
                else len(gen.prompt_token_ids) + gen.params.max_tokens)
        candidates = [w for w in self.registry.candidates(model_id, need)
                      if w.hello.embedding_size or not gen.embed]
        if not candidates:
            raise NoWorkerError(f"no ready worker serves {model_id!r} with a context of "
                                f"{need} tokens")
        worker = self.router.pick(candidates, gen.prompt_token_ids, gen.cache_salt)
        entry = self.registry.models.get(model_id)
        handle = RequestHandle(gen, worker, deadline, entry.vocab_size if entry else None)
        self.requests[gen.request_id] = handle
        await self._send_generate(handle, worker)
        return handle

    async def cancel(self, handle: RequestHandle) -> None:
        """Forget the request here and tell its worker to stop it. Idempotent."""
        if handle.closed:
            return
        self.release(handle)
        if handle.worker.identity in self.workers:
            await self.link.send(handle.worker.identity, m.Cancel(handle.request_id))

    async def cancel_choice(self, handle: RequestHandle, index: int) -> None:
        """Tell the worker to stop one choice of a request that goes on (n > 1)."""
        if not handle.closed and handle.worker.identity in self.workers:
            await self.link.send(handle.worker.identity, m.Cancel(handle.request_id, index))

    def fail_all(self, reason: str) -> None:
        """End every request in flight (the drain timeout passed): each gets a Stopping event,
        and its Generation's close() then cancels it at its worker."""
        for handle in list(self.requests.values()):
            handle.events.put_nowait(Stopping(reason))

    def release(self, handle: RequestHandle) -> None:
        """The request is over (finished, failed or cancelled): stop routing frames to it."""
        handle.closed = True
        self.requests.pop(handle.request_id, None)
        handle.worker.forget(handle.request_id, handle.gen.params.n)

    # ---- sending ----------------------------------------------------------------------------

    async def _send_generate(self, handle: RequestHandle, worker: WorkerState) -> None:
        handle.worker = worker
        worker.take(handle.request_id, handle.gen.params.n)
        gen = replace(handle.gen, timeout_s=handle.remaining(), deadline=None)
        if not await self.link.send(worker.identity, gen):
            self._drop_worker(worker, "unreachable")

    # ---- receiving --------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        # A receive returns at once while frames are queued, without a turn of the event loop:
        # a worker sending as fast as the link takes them would hold the loop (every route,
        # /health). So the loop is given up after a turn's budget of frames or time, whichever
        # comes first. Not after every frame: the streams then woke once per token each, where
        # a turn of several frames lets each stream take its queued tokens in one wake-up (one
        # SSE write); yielding per frame cut the ceiling from ~60,000 tokens/s to ~12,000.
        frames, turn = 0, time.perf_counter()
        while True:
            identity, body = await self.link.recv()
            try:
                await self._on_frames(identity, body)
            except Exception:  # one bad frame or bug must not stop the link
                log.exception("error while handling a frame from a worker")
            frames += 1
            if frames >= self.turn_frames or time.perf_counter() - turn >= self.turn_s:
                await asyncio.sleep(0)
                frames, turn = 0, time.perf_counter()

    async def _on_frames(self, identity: bytes, body: list[bytes]) -> None:
        worker = self.workers.get(identity)
        kind = codec.peek_type(body)
        if worker is None:
            if kind is m.Hello:
                self.membership.start_hello(identity, body)
            elif kind is not None and kind is not m.WorkerDying:
                await self.membership.reset(identity)  # never decoded: unknown peers get no CPU
            return
        worker.last_seen = time.monotonic()  # any frame is proof of life
        if kind is m.Hello:
            self.membership.start_hello(identity, body)  # a repeated Hello: off the loop too
            return
        if kind is m.StepOutputs:
            # A step has a row per sequence it ran for us: those in flight, plus as many again
            # for requests cancelled while its step ran. More is no step, and it is refused
            # before decoding (a frame of 2 MiB of rows held the loop for ~0.1 s).
            rows, most = codec.step_rows(body) or 0, worker.sequences + worker.capacity
            if rows > most:
                self._refuse(worker, f"a step's frame of {rows} rows where at most {most} "
                                     "sequences could have run")
                return
        try:
            msg = codec.decode(body)  # small: codec limits non-Hello payloads to 64 KiB
        except codec.DecodeError as exc:
            log.warning("dropped a frame from worker %s that did not decode: %s", worker.name, exc)
            await self.link.send(identity, m.ProtocolError(f"gateway could not decode: {exc}"))
            return
        await self._dispatch(worker, msg)

    def _deliver(self, worker: WorkerState, msg: m.TokenOutput | m.RequestError) -> None:
        handle = self.requests.get(msg.request_id)
        if handle is None or handle.worker is not worker:
            return
        handle.answered = True
        if isinstance(msg, m.RequestError):
            msg = replace(msg, message=msg.message[:1000], code=msg.code[:64])
        elif (why := _refusal(handle, msg)) is not None:
            self._refuse(worker, why, handle)
            return
        handle.events.put_nowait(msg)

    def _refuse(self, worker: WorkerState, why: str, handle: RequestHandle | None = None) -> None:
        """A frame no honest worker sends: its request (if any) ends with a 502 and is cancelled
        at the worker; the worker is dropped once it has done so MAX_WORKER_FAULTS times."""
        now = time.monotonic()
        worker.faults = [t for t in worker.faults if now - t < FAULT_WINDOW_S] + [now]
        log.warning("worker %s sent a frame the gateway refuses (%d of %d in %.0f s): %s",
                    worker.name, len(worker.faults), MAX_WORKER_FAULTS, FAULT_WINDOW_S, why)
        if handle is not None:
            handle.events.put_nowait(m.RequestError(
                handle.request_id, f"the worker sent a frame the gateway refuses: {why}",
                "bad_worker_frame"))
            self.release(handle)
            self._spawn(self.link.send(worker.identity, m.Cancel(handle.request_id)),
                        "engine-cancel")
        if len(worker.faults) >= MAX_WORKER_FAULTS:
            self._drop_worker(worker, f"sent {len(worker.faults)} frames the gateway refuses "
                                      f"in {FAULT_WINDOW_S:.0f} s")
            self.membership.ban(worker.identity, FAULT_WINDOW_S)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def _dispatch(self, worker: WorkerState, msg: Any) -> None:
        if isinstance(msg, m.StepOutputs):  # the codec checked each finish_reason's value
            if not msg.outputs:
                self._refuse(worker, "a step's frame with no outputs")
            for out in msg.outputs:
                self._deliver(worker, out)
        elif isinstance(msg, (m.TokenOutput, m.RequestError)):
            if isinstance(msg, m.TokenOutput) and msg.finish_reason not in (None, *FINISH_REASONS):
                msg = replace(msg, finish_reason="abort")  # it becomes a metric label: bounded
            self._deliver(worker, msg)
        elif isinstance(msg, m.Heartbeat):
            worker.on_heartbeat(msg)
            for callback in self.on_stats:
                callback(worker, msg.stats)
        elif isinstance(msg, m.WorkerDying):
            log.warning("worker %s is going away: %s", worker.name, msg.reason[:200])
            self._drop_worker(worker, "worker exited")
        elif isinstance(msg, m.ProtocolError):
            log.warning("worker %s could not decode a frame of ours: %s", worker.name,
                        msg.message[:200])

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
        worker.forget_all()

    def _retry(self, handle: RequestHandle, lost: WorkerState) -> bool:
        """Send a request that got nothing back yet to another worker, once."""
        need = len(handle.gen.prompt_token_ids) + handle.gen.params.max_tokens
        others = [w for w in self.registry.candidates(lost.hello.model_id, need) if w is not lost]
        if not others or handle.remaining() == 0.0:
            return False
        handle.retried = True
        target = self.router.pick(others, handle.gen.prompt_token_ids)
        self._spawn(self._send_generate(handle, target), "engine-retry")
        return True


def _refusal(handle: RequestHandle, out: m.TokenOutput) -> str | None:
    """Why no honest worker sends this frame for this request; None: it is taken (and counted).
    A worker is trusted with its model's output, never with the gateway: at most max_tokens
    tokens of the model's vocabulary and one last frame per choice get through."""
    n, i = len(handle.tokens), out.index
    if not 0 <= i < n:
        return f"a frame for choice {i} of a request with n={n}"
    if handle.ended[i]:
        return f"a frame for choice {i} after its last"
    if not out.token_ids and out.finish_reason is None:
        return "a frame with no token and no finish"
    total, most = handle.tokens[i] + len(out.token_ids), handle.gen.params.max_tokens
    if total > most:
        return f"{total} tokens for choice {i}, over the request's max_tokens of {most}"
    vocab = handle.vocab_size
    if vocab is not None and any(not 0 <= t < vocab for t in out.token_ids):
        return f"a token id outside the model's vocabulary of {vocab}"
    if out.logprobs is not None and len(out.logprobs) != len(out.token_ids):
        return f"{len(out.logprobs)} logprob entries for {len(out.token_ids)} tokens"
    if out.logprobs is not None and not all(
            math.isfinite(lp) and all(math.isfinite(t[1]) for t in top)
            for _, lp, top in out.logprobs):
        return "a logprob that is NaN or infinite (JSON cannot carry it)"
    if out.embedding is not None or handle.gen.embed:
        why = _embedding_refusal(handle, out)
        if why is not None:
            return why
    handle.tokens[i] = total
    handle.ended[i] = out.finish_reason is not None
    return None


def _embedding_refusal(handle: RequestHandle, out: m.TokenOutput) -> str | None:
    """An embedding request gets one vector of its worker's size per input, and no tokens;
    a generation no vector."""
    if not handle.gen.embed:
        return "an embedding for a request that asked for tokens"
    if out.token_ids:
        return "tokens for an embedding request"
    if out.embedding is None:
        return None  # an input ended without its vector (aborted, timed out)
    size = handle.worker.hello.embedding_size
    if len(out.embedding) != 4 * size:
        return f"an embedding of {len(out.embedding)} bytes from a worker of size {size}"
    if not all(math.isfinite(x) for x in struct.unpack(f"<{size}f", out.embedding)):
        return "an embedding with a NaN or infinite value (JSON cannot carry it)"
    return None
