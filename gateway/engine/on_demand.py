"""Models loaded on demand (`kestrel serve --models-dir`): one owner of every model's lifecycle,
and one queue, in arrival order, of the requests that wait for a model, as llama.cpp's router
mode and Ollama's scheduler do.

    a request for model M ──claim(M, deadline)──▶ a Claim in the queue (its arrival number)
        ──poll()──▶ states moved by what the launcher and the registry show:
            unloaded ─start─▶ loading ─its worker joins─▶ ready ─unload─▶ unloading ─exits─▶
            unloaded; loading ─its process exits─▶ failed (its waiters get 503 naming why)
        ──schedule──▶ a claim whose model is ready is granted (the request goes on to take its
            queue place, then releases the claim); the first claim whose model needs a load
            (the head) starts it when --models-max leave room, else unloads the least recently
            used idle model and waits for its process to go. Claims behind the head wait, even
            for a loaded model, unless that model was loaded for them: loads follow arrivals.
    Claim.wait() ──▶ returns once granted; 503 if the load failed, 504 at the deadline, 429 when
        the model's last load took longer than the deadline leaves (refused before loading)
    Claim.release() ──▶ the request has its queue place (admission counts it from then) or left
    run() (a task of the app) ──▶ poll() every 50 ms, whoever waits; idle models unloaded after
        --sleep-idle-seconds
    POST /models/load, /models/unload ──▶ the same, by hand (409 for a model with requests)
    /tokenize, /detokenize, count_tokens ──tokenizer_entry──▶ never load: the tokenizer its last
        worker announced, or 409 before its first load

Invariants: a load ends when its worker joins or its process exits, whether or not anyone still
waits (a waiter that leaves only stops counting); a model is chosen for eviction only with no
request queued or running (admission's count), no granted claim (a request between its grant and
its queue place) and no waiting claim it was loaded for. Workers that join from other hosts
count as loaded and are never stopped here (only the processes this server started are).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.engine.registry import ModelEntry, Registry
from gateway.http.errors import APIError, too_many_requests

log = logging.getLogger("kestrel.gateway")

STATUSES = ("loaded", "loading", "unloaded")  # what /v1/models says of a model
STATES = ("unloaded", "loading", "ready", "unloading", "failed")
UNLOAD_REASONS = ("lru", "idle", "manual")
LOAD_BUCKETS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
POLL_S = 0.05


class Spawner(Protocol):
    """The launcher's worker processes, one per model id of its catalog."""

    catalog: dict[str, str]  # model id -> its file or folder

    def start(self, model_id: str) -> None: ...

    def stop(self, model_id: str) -> None: ...

    def running(self, model_id: str) -> bool: ...

    def failure(self, model_id: str) -> str | None:
        """Why the model's last process ended without being stopped (None: it did not)."""
        ...


@dataclass
class Life:
    """One model's lifecycle, moved only by OnDemand.poll() and the pool's own start/unload."""

    state: str = "unloaded"
    started_at: float = 0.0  # when its current load started
    last_used: float = 0.0
    load_s: float | None = None  # how long its last load took: what a deadline is judged by
    load_seq: int = -1  # the last arrival number when its load started: it was loaded for those
    claims: int = 0  # granted claims not released yet (requests on their way to a queue place)
    failure: str | None = None


class Claim:
    """One request's hold on its model, from its arrival until it has its place in the queue
    (or leaves). Its owner releases it, always (a `finally`)."""

    def __init__(self, pool: OnDemand | None, model_id: str | None, deadline: float | None,
                 seq: int, arrival: float) -> None:
        self.pool, self.model_id, self.deadline = pool, model_id, deadline
        self.seq, self.arrival = seq, arrival
        self.granted = pool is None  # a name outside the folder: left to the route
        self.error: APIError | None = None
        self.released = False

    async def wait(self) -> None:
        """Return once granted; APIError 503 (load failed), 504 (deadline), 429 (refused)."""
        pool = self.pool
        while not self.granted:
            assert pool is not None
            pool.poll()
            if self.error is not None:
                raise self.error
            if self.granted:
                break
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise APIError(504, f"the request's deadline passed while model "
                               f"{self.model_id!r} was loading", code="timeout")
            await asyncio.sleep(POLL_S)

    def release(self) -> None:
        if self.released or self.pool is None:
            return
        self.released = True
        self.pool._released(self)


class OnDemand:
    def __init__(self, spawner: Spawner, registry: Registry, busy: Callable[[str], int],
                 models_max: int = 0, sleep_idle_s: float = 0.0,
                 metrics: CollectorRegistry | None = None) -> None:
        self.spawner = spawner
        self.registry = registry
        self.busy = busy  # requests the admission counts for a model (queued or running)
        self.models_max = models_max  # 0: no bound
        self.sleep_idle_s = sleep_idle_s  # 0: never unloaded for idleness
        self.lives = {m: Life(last_used=time.monotonic()) for m in self.catalog}
        self.queue: list[Claim] = []  # waiting claims, in arrival order
        self.entries: dict[str, ModelEntry | None] = {}  # as each model's last worker said
        self._seq = 0
        self.loaded_gauge = Gauge("kestrel_models_loaded", "models with a worker of this "
                                  "server's running", registry=metrics)
        self.loaded_gauge.set_function(lambda: sum(map(self.spawner.running, self.catalog)))
        self.load_seconds = Histogram("kestrel_model_load_seconds", "seconds from starting a "
                                      "model's worker to its joining", buckets=LOAD_BUCKETS,
                                      registry=metrics)
        self.loads = Counter("kestrel_model_loads", "model workers started", registry=metrics)
        self.unloads = Counter("kestrel_model_unloads", "models unloaded, by reason",
                               ["reason"], registry=metrics)
        for reason in UNLOAD_REASONS:
            self.unloads.labels(reason)
        self.poll()  # a model the launcher started with us is loading already

    @property
    def catalog(self) -> dict[str, str]:
        return self.spawner.catalog

    def state(self, model_id: str) -> str:
        return self.lives[model_id].state

    def status(self, model_id: str) -> str:
        self.poll()
        if self._serving(model_id):
            return "loaded"
        return "loading" if self.lives[model_id].state == "loading" else "unloaded"

    def _serving(self, model_id: str) -> bool:
        """A worker of it is ready now (this server's, or one from another host), and it is
        not on its way out."""
        return self.lives[model_id].state != "unloading" and \
            bool(self.registry.candidates(model_id))

    def default_model(self) -> str | None:
        """What a request naming no model gets: the first loaded, else the catalog's first."""
        loaded = next(iter(self.registry.models), None)
        return loaded or next(iter(self.catalog), None)

    def ready(self, name: str | None) -> bool:
        """Whether a request for `name` would be served by a worker now (a name outside the
        folder is the route's business: True)."""
        model_id = name or self.default_model()
        return model_id is None or model_id not in self.catalog or self._serving(model_id)

    def tokenizer_entry(self, name: str | None) -> ModelEntry | None:
        """For routes that only tokenize (never a reason to load weights): the model's entry
        as its last worker announced it while no worker serves it; None where the registry
        answers (a model served now, a name outside the folder); 409 for a model never loaded
        since the server started (its tokenizer comes with its worker's hello)."""
        model_id = name or self.default_model()
        if model_id is None or model_id not in self.catalog or self._serving(model_id):
            return None
        entry = self.entries.get(model_id)
        if entry is None:
            raise APIError(409, f"model {model_id!r} is not loaded, and its tokenizer comes with "
                           "its worker: a generation request loads it", param="model",
                           code="model_not_loaded")
        return entry

    # -- claims ---------------------------------------------------------------------------

    def claim(self, name: str | None, deadline: float | None) -> Claim:
        """A request's claim on the model `name` (an id of the catalog; other names are left to
        the route), queued in arrival order and granted at once where it may go on."""
        model_id = name or self.default_model()
        now = time.monotonic()
        if model_id is None or model_id not in self.catalog:
            return Claim(None, model_id, deadline, -1, now)
        self._seq += 1
        claim = Claim(self, model_id, deadline, self._seq, now)
        self.lives[model_id].last_used = now
        self.queue.append(claim)
        self.poll()
        return claim

    async def ensure(self, name: str | None, deadline: float | None) -> None:
        """Wait for `name` to be loaded and let go at once (/models/load)."""
        claim = self.claim(name, deadline)
        try:
            await claim.wait()
        finally:
            claim.release()

    def _grant(self, claim: Claim) -> None:
        self.queue.remove(claim)
        claim.granted = True
        self.lives[claim.model_id].claims += 1  # type: ignore[index]

    def _refuse(self, claim: Claim, error: APIError) -> None:
        self.queue.remove(claim)
        claim.error = error

    def _released(self, claim: Claim) -> None:
        life = self.lives[claim.model_id]  # type: ignore[index]
        life.last_used = time.monotonic()
        if claim.granted:
            life.claims -= 1
        elif claim in self.queue:  # it left while waiting: it only stops counting
            self.queue.remove(claim)
        self.poll()

    # -- events ---------------------------------------------------------------------------

    def poll(self) -> None:
        """Move every model's state by what its process and the registry show, then serve the
        queue. Called by the app's task every 50 ms and by whoever waits: idempotent."""
        now = time.monotonic()
        for model_id, life in self.lives.items():
            self._observe(model_id, life, now)
        self._schedule(now)

    def _observe(self, model_id: str, life: Life, now: float) -> None:
        running = self.spawner.running(model_id)
        if life.state == "loading":
            if running and self.registry.candidates(model_id):
                life.state, life.load_s = "ready", now - life.started_at
                # its tokenizer, as its worker announced it, outlives the worker
                self.entries[model_id] = self.registry.model(model_id) or \
                    self.entries.get(model_id)
                self.load_seconds.observe(life.load_s)
                log.info("model %s loaded in %.1f s", model_id, life.load_s)
            elif not running:
                why = self.spawner.failure(model_id) or "its worker exited before it joined"
                life.state, life.failure = "failed", why
                log.error("model %s failed to load: %s", model_id, why)
                error = APIError(503, f"model {model_id!r} failed to load: {why}",
                                 param="model", code="model_load_failed")
                for claim in [c for c in self.queue if c.model_id == model_id]:
                    self._refuse(claim, error)
        elif life.state in ("ready", "unloading") and not running:
            why = self.spawner.failure(model_id) if life.state == "ready" else None
            if why is not None:
                log.error("model %s's worker ended: %s", model_id, why)
            life.state, life.failure = ("failed", why) if why else ("unloaded", None)
        elif life.state in ("unloaded", "failed") and running:  # started by the launcher
            life.state, life.started_at, life.load_seq = "loading", now, self._seq
            self._observe(model_id, life, now)

    def _schedule(self, now: float) -> None:
        """Grant what may go on; let the head of the queue (the first claim whose model needs a
        load) start it or make room for it. Nobody behind the head swaps."""
        head_waits = False
        for claim in list(self.queue):
            model_id = claim.model_id
            assert model_id is not None
            life = self.lives[model_id]
            if self._serving(model_id):
                if not head_waits or claim.seq <= life.load_seq:
                    self._grant(claim)
                continue
            if life.state == "loading" or head_waits:
                continue
            if life.state != "unloading" and self._unreachable(claim, life, now):
                continue
            if life.state != "unloading" and self._room():
                self._start(model_id, now)
                continue
            head_waits = True
            if life.state != "unloading":
                self._make_room(model_id)

    def _unreachable(self, claim: Claim, life: Life, now: float) -> bool:
        """Refuse, before its load starts, a request whose deadline its model's last load time
        does not fit (400 if it could never have, 429 if its wait used the time up)."""
        if claim.deadline is None or life.load_s is None or now + life.load_s <= claim.deadline:
            return False
        message = (f"model {claim.model_id!r} is not loaded and its last load took "
                   f"{life.load_s:.1f} s, more than this request's deadline leaves")
        if claim.arrival + life.load_s > claim.deadline:
            self._refuse(claim, APIError(400, message + ": raise its timeout", param="timeout",
                                         code="deadline_unreachable"))
        else:
            self._refuse(claim, too_many_requests(message, "deadline_unreachable", life.load_s))
        return True

    def _running(self) -> list[str]:
        return [m for m in self.catalog if self.spawner.running(m)]  # unloading ones count

    def _room(self) -> bool:
        return not self.models_max or len(self._running()) < self.models_max

    def _make_room(self, for_model: str) -> None:
        """Unload the least recently used idle model, unless one is on its way out already
        (its room, not another victim's); with every loaded model busy, the head waits."""
        running = self._running()
        if any(self.lives[m].state == "unloading" for m in running):
            return
        idle = [m for m in running if m != for_model and self.lives[m].state == "ready"
                and self._idle(m)]
        if idle:
            self._unload(min(idle, key=lambda m: self.lives[m].last_used), "lru")

    def _idle(self, model_id: str) -> bool:
        """No request queued or running for it, none on its way to a queue place, none waiting
        that it was loaded for."""
        life = self.lives[model_id]
        return self.busy(model_id) == 0 and life.claims == 0 and not any(
            c.model_id == model_id and c.seq <= life.load_seq for c in self.queue)

    def _start(self, model_id: str, now: float) -> None:
        life = self.lives[model_id]
        life.state, life.started_at, life.load_seq = "loading", now, self._seq
        life.failure, life.last_used = None, now
        log.info("loading model %s", model_id)
        self.loads.inc()
        self.spawner.start(model_id)

    def _unload(self, model_id: str, reason: str) -> None:
        log.info("unloading model %s (%s)", model_id, reason)
        self.unloads.labels(reason).inc()
        self.lives[model_id].state = "unloading"
        self.spawner.stop(model_id)

    def unload(self, model_id: str) -> None:
        """By hand (POST /models/unload): 404 unknown, 409 with requests (a load nobody waits
        for any more is stopped)."""
        if model_id not in self.catalog:
            raise APIError(404, f"model {model_id!r} is not in the models folder", param="model",
                           code="model_not_found")
        self.poll()
        if not self._idle(model_id) or any(c.model_id == model_id for c in self.queue):
            raise APIError(409, f"model {model_id!r} has requests in flight or waiting for "
                           "it: it is not unloaded under them", param="model", code="model_busy")
        if self.lives[model_id].state in ("loading", "ready") and self.spawner.running(model_id):
            self._unload(model_id, "manual")

    async def run(self) -> None:
        """The app's task: the lifecycle moves whoever waits; idle models unloaded."""
        while True:
            await asyncio.sleep(POLL_S)
            self.poll()
            if self.sleep_idle_s > 0:
                self._sleep_idle(time.monotonic())

    def _sleep_idle(self, now: float) -> None:
        for model_id, life in self.lives.items():
            if life.state == "ready" and self.spawner.running(model_id) and \
                    self._idle(model_id) and now - life.last_used >= self.sleep_idle_s:
                self._unload(model_id, "idle")
