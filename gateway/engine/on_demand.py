"""Models loaded on demand (`kestrel serve --models-dir DIR`): which are loaded, which to start
for a request, which to unload, as llama.cpp's router mode and Ollama do.

    a request for model M ──ensure(M, deadline)──▶ M has a ready worker: go on (a stream is
        answered 200 first and kept alive meanwhile: gateway.api.exchange)
        M unloaded: unload the least recently used idle model if --models-max are up, start M's
        worker (the launcher's Spawner: kestrel/worker_processes.py), wait for it to join
        (503 model_load_failed naming why its process ended; 504 at the request's deadline)
    every second ──▶ a model nobody asked for in --sleep-idle-seconds is unloaded (its worker
        process exits and its memory goes back to the host)
    POST /models/load, /models/unload ──▶ the same, by hand (409 for a model with requests)

A model is busy while the admission of its requests counts any (queued or running) or a request
waits for it to load: only idle models are unloaded, so none is unloaded under its requests.
The route calls `ensure` right before it takes its place in the queue, with no await in between,
so an unload cannot slip between the two. Workers that join from other hosts count as loaded and
are never stopped here (only the processes this server started are).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.api.errors import APIError
from gateway.engine.registry import Registry

log = logging.getLogger("kestrel.gateway")

STATUSES = ("loaded", "loading", "unloaded")
UNLOAD_REASONS = ("lru", "idle", "manual")
LOAD_BUCKETS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)


class Spawner(Protocol):
    """The launcher's worker processes, one per model id of its catalog."""

    catalog: dict[str, str]  # model id -> its file or folder

    def start(self, model_id: str) -> None: ...

    def stop(self, model_id: str) -> None: ...

    def running(self, model_id: str) -> bool: ...

    def failure(self, model_id: str) -> str | None:
        """Why the model's last process ended without being stopped (None: it did not)."""
        ...


class OnDemand:
    def __init__(self, spawner: Spawner, registry: Registry, busy: Callable[[str], int],
                 models_max: int = 0, sleep_idle_s: float = 0.0,
                 metrics: CollectorRegistry | None = None) -> None:
        self.spawner = spawner
        self.registry = registry
        self.busy = busy  # requests the admission counts for a model (queued or running)
        self.models_max = models_max  # 0: no bound
        self.sleep_idle_s = sleep_idle_s  # 0: never unloaded for idleness
        self.last_used: dict[str, float] = {}
        self.started_at: dict[str, float] = {}  # models loading: when their worker started
        self.waiters: dict[str, int] = {}  # requests waiting for a model to load
        self.stopping: set[str] = set()  # told to exit, not gone yet: never handed requests
        now = time.monotonic()
        self.last_used = {m: now for m in self.catalog if spawner.running(m)}  # started with us
        self.loaded_gauge = Gauge("kestrel_models_loaded", "models with a worker of this "
                                  "server's running", registry=metrics)
        self.loaded_gauge.set_function(lambda: sum(map(self.spawner.running, self.catalog)))
        self.load_seconds = Histogram("kestrel_model_load_seconds", "seconds from starting a "
                                      "model's worker to its joining", buckets=LOAD_BUCKETS,
                                      registry=metrics)
        self.unloads = Counter("kestrel_model_unloads", "models unloaded, by reason",
                               ["reason"], registry=metrics)
        for reason in UNLOAD_REASONS:
            self.unloads.labels(reason)

    @property
    def catalog(self) -> dict[str, str]:
        return self.spawner.catalog

    def status(self, model_id: str) -> str:
        if self._stopping(model_id):
            return "unloaded"  # on its way out
        if self.registry.candidates(model_id):
            return "loaded"
        return "loading" if self.spawner.running(model_id) else "unloaded"

    def _stopping(self, model_id: str) -> bool:
        if model_id in self.stopping and not self.spawner.running(model_id):
            self.stopping.discard(model_id)  # gone
        return model_id in self.stopping

    def _ready(self, model_id: str) -> bool:
        return not self._stopping(model_id) and bool(self.registry.candidates(model_id))

    def default_model(self) -> str | None:
        """What a request naming no model gets: the first loaded, else the catalog's first."""
        loaded = next(iter(self.registry.models), None)
        return loaded or next(iter(self.catalog), None)

    def ready(self, name: str | None) -> bool:
        """Whether a request for `name` would go on at once (a name outside the folder does)."""
        model_id = name or self.default_model()
        return model_id is None or model_id not in self.catalog or self._ready(model_id)

    async def ensure(self, name: str | None, deadline: float | None) -> None:
        """Return once the model `name` (an id of the catalog; other names are left to the
        route) has a ready worker; APIError 503 if it fails to load, 504 at `deadline`."""
        model_id = name or self.default_model()
        if model_id is None or model_id not in self.catalog:
            return
        self.last_used[model_id] = time.monotonic()
        if self._ready(model_id):
            return
        self.waiters[model_id] = self.waiters.get(model_id, 0) + 1
        try:
            while not self._ready(model_id):
                if not self.spawner.running(model_id):
                    why = self.spawner.failure(model_id) if model_id in self.started_at else None
                    if why is not None:
                        self.started_at.pop(model_id, None)
                        raise APIError(503, f"model {model_id!r} failed to load: {why}",
                                       param="model", code="model_load_failed")
                    if self._room_for(model_id):
                        self._start(model_id)
                if deadline is not None and time.monotonic() >= deadline:
                    raise APIError(504, f"the request's deadline passed while model "
                                   f"{model_id!r} was loading", code="timeout")
                await asyncio.sleep(0.05)
        finally:
            self.waiters[model_id] -= 1
        started = self.started_at.pop(model_id, None)
        if started is not None:
            self.load_seconds.observe(time.monotonic() - started)
            log.info("model %s loaded in %.1f s", model_id, time.monotonic() - started)
        self.last_used[model_id] = time.monotonic()

    def _start(self, model_id: str) -> None:
        self.started_at[model_id] = self.last_used[model_id] = time.monotonic()
        log.info("loading model %s", model_id)
        self.spawner.start(model_id)

    def _room_for(self, model_id: str) -> bool:
        """Whether another model may start now, unloading the least recently used idle one
        when --models-max are up (False: all are busy; the caller waits)."""
        running = [m for m in self.catalog if self.spawner.running(m)]  # stopping ones count
        if not self.models_max or len(running) < self.models_max:
            return True
        if any(self._stopping(m) for m in running):
            return False  # one is on its way out already: its room, not another victim's
        idle = [m for m in running if m != model_id and not self._stopping(m) and self._idle(m)]
        if not idle:
            return False
        victim = min(idle, key=lambda m: self.last_used.get(m, 0.0))
        self._unload(victim, "lru")
        return False  # its process is on its way out: start once it has gone

    def _idle(self, model_id: str) -> bool:
        return self.busy(model_id) == 0 and self.waiters.get(model_id, 0) == 0 \
            and model_id not in self.started_at

    def _unload(self, model_id: str, reason: str) -> None:
        log.info("unloading model %s (%s)", model_id, reason)
        self.unloads.labels(reason).inc()
        self.stopping.add(model_id)
        self.last_used.pop(model_id, None)
        self.spawner.stop(model_id)

    def unload(self, model_id: str) -> None:
        """By hand (POST /models/unload): 404 unknown, 409 busy."""
        if model_id not in self.catalog:
            raise APIError(404, f"model {model_id!r} is not in the models folder", param="model",
                           code="model_not_found")
        if not self._idle(model_id):
            raise APIError(409, f"model {model_id!r} has requests in flight or loading: it is "
                           "not unloaded under them", param="model", code="model_busy")
        if self.spawner.running(model_id) and not self._stopping(model_id):
            self._unload(model_id, "manual")

    async def sleep_idle(self) -> None:
        """Unload the models nobody asked for in --sleep-idle-seconds (a task of the app)."""
        while True:
            await asyncio.sleep(min(1.0, max(0.05, self.sleep_idle_s / 4)))
            now = time.monotonic()
            for model_id in list(self.catalog):
                used = self.last_used.get(model_id)
                if self.spawner.running(model_id) and not self._stopping(model_id) \
                        and self._idle(model_id) and \
                        now - (used if used is not None else 0.0) >= self.sleep_idle_s:
                    self._unload(model_id, "idle")
