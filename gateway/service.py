"""The gateway's composition root: builds its parts once and wires them; no request logic.

    auth (keys, rate limit) ──▶ admit.precheck ──▶ heavy (large bodies) ──▶ intake.read ──▶
    admit.reserve ──▶ intake.prepare ──▶ admit.check_fit / admit.seat ──▶ a Generation ──▶
    formatters ──▶ accounting.record

The request path itself reads in gateway.api.exchange, one object per request. Here: the
shutdown drain, readiness, and what /health and /v1/models show.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.admission.admit import Admitter
from gateway.admission.auth import Auth
from gateway.admission.heavy import Heavy
from gateway.admission.rate_limit import RateLimiter
from gateway.admission.shared_limits import SharedRateLimiter
from gateway.config import GatewayConfig
from gateway.engine.engine_client import EngineClient
from gateway.engine.on_demand import OnDemand, Spawner
from gateway.prompt.intake import Intake
from gateway.telemetry.accounting import Accounting
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import RequestTracer


class GatewayState:
    def __init__(self, cfg: GatewayConfig, spawner: Spawner | None = None) -> None:
        self.cfg = cfg
        self.client = EngineClient.from_config(cfg)
        self.metrics = Metrics(lambda: list(self.client.workers.values()))
        self.accounting = Accounting(self.metrics, RequestTracer.create(cfg.otlp_endpoint))
        # With several API server processes the buckets live in the file they all map.
        limiter = SharedRateLimiter(cfg.shared_state, cfg.rate_limit_rps, cfg.rate_limit_burst) \
            if cfg.shared_state else RateLimiter(cfg.rate_limit_rps, cfg.rate_limit_burst)
        self.auth = Auth(cfg.keys(), limiter, self.metrics.rejections)
        self.heavy = Heavy(rejections=self.metrics.rejections)
        self.intake = Intake(cfg, self.client)
        self.admit = Admitter(cfg, self.client, self.metrics.rejections)
        self.admission = self.admit.admission
        self.accounting.watch(self.admission, self.client)
        self.client.on_stats.append(lambda _w, _s: self.admission.poke())
        # `kestrel serve --models-dir`: models loaded on demand (None: the workers that join)
        self.models_on_demand = None if spawner is None else OnDemand(
            spawner, self.client.registry, self._busy, cfg.models_max, cfg.sleep_idle_seconds,
            self.metrics.registry)
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the app's lifespan
        self.http_in_flight = [0]  # HTTP requests in progress (errors.CatchAll counts them)

    @property
    def draining(self) -> bool:
        return self.admit.draining

    def _busy(self, model_id: str) -> int:
        adm = self.admission.by_model.get(model_id)
        return 0 if adm is None else adm.outstanding + adm.waiting

    @property
    def ready(self) -> bool:
        # on demand, a server with nothing loaded is ready: a request loads what it asks for
        serving = self.client.ready or self.models_on_demand is not None
        return serving and not self.draining and not self.admission.queue_full

    @property
    def idle(self) -> bool:
        """No HTTP request in progress, nothing admitted or waiting: a drain may end."""
        return (self.http_in_flight[0] == 0 and self.admission.outstanding == 0
                and self.admission.waiting == 0)

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work at once (this may run in a signal handler, so the rest is
        handed to the loop): fail the queued requests, and when drain_timeout_s has passed,
        end what still runs with a 503 in its own shape (a stream's error event, then [DONE])."""
        if self.admit.draining:  # a second signal: the drain is already under way
            return
        self.admit.draining = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self.admission.reject_waiters()
        self.intake.readers.stop()  # bodies still arriving: 503 now
        asyncio.get_running_loop().call_later(
            self.cfg.drain_timeout_s, self.client.fail_all,
            "the server is shutting down and its drain timeout has passed")

    def health(self) -> dict[str, Any]:
        # "id" is the gateway's opaque name for the worker, never its worker id (which is also
        # its routing id on the engine link).
        workers = [{"id": w.name, "model": w.hello.model_id, "ready": w.ready,
                    "draining": w.draining, "in_flight": len(w.inflight),
                    "device": w.hello.device, "matmul_plan": w.hello.matmul_plan,
                    # what one decode step of one sequence reads (issue 53)
                    "decode_read_mb": round(w.hello.decode_read_bytes / 1e6, 1),
                    "kv_cache_dtype": w.hello.kv_cache_dtype,
                    "kv_bytes_per_token": w.hello.kv_bytes_per_token,
                    "running": w.stats.running,
                    "waiting": w.stats.waiting,
                    "last_seen_s": round(time.monotonic() - w.last_seen, 3)}
                   for w in self.client.workers.values()]
        status = "ok" if self.ready else ("draining" if self.draining else
                                          "queue_full" if self.admission.queue_full
                                          else "no_worker")
        admission = self.admission
        return {"status": status, "models": list(self.client.models), "workers": workers,
                "queue": {"waiting": admission.waiting, "max_queue": admission.max_queue,
                          "outstanding": admission.outstanding},
                # which of the API server processes answered (gateway.api_servers)
                "api_server": {"index": self.cfg.api_server_index,
                               "count": self.cfg.api_server_count}}

    def models(self) -> list[dict[str, Any]]:
        data = []
        pool = self.models_on_demand
        for entry in self.client.models.values():
            h = entry.hello
            # An alias is listed as a model of its own (as vLLM lists every served name);
            # `root` names the id that responses carry.
            for name in (entry.model_id, *h.aliases):
                data.append({"id": name, "object": "model", "created": entry.created,
                             "owned_by": "kestrel", "root": entry.model_id,
                             "max_model_len": h.max_model_len, "dtype": h.dtype,
                             "quantization": h.quantization, "weight_bytes": h.weight_bytes,
                             **({} if pool is None else {"status": pool.status(entry.model_id)})})
        if pool is not None:  # the folder's models without a worker now: loading or unloaded
            listed = {d["id"] for d in data}
            data += [{"id": model_id, "object": "model", "created": 0, "owned_by": "kestrel",
                      "root": model_id, "status": pool.status(model_id)}
                     for model_id in pool.catalog if model_id not in listed]
        return data
