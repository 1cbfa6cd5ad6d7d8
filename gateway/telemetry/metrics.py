"""Prometheus metrics for the whole system, scraped from the gateway in one namespace (`kestrel_`).

    a request ends ──accounting.record()──▶ request counter, latency and length histograms, tokens
    worker heartbeat (Stats, every 0.25 s) ──▶ WorkerState.stats ──WorkerCollector, at scrape──▶
        per-worker gauges and counters, label `worker` (the gateway's opaque name for it)
    admission and the engine link ──set_function, at scrape──▶ waiting / in-flight / ready gauges

Token counters are the gateway's own: every token a request received from its worker, aborted and
timed-out requests' included, so they equal the sums of the responses' `usage` at every moment.
The workers' own totals (which also count tokens sampled after a cancel or past a stop string)
are exported beside them as `kestrel_worker_*_tokens_total`.

Each app gets its own registry: no global state, and tests can run several apps in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from protocol import messages as m

NS = "kestrel"
# 1 ms to 60 s in steps of about x2: resolves a fast inter-token gap and a long generation.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.25, 0.5, 1.0, 2.0, 4.0,
                   8.0, 15.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ROUTES = ("completions", "chat", "generate", "generate_stream")
REJECT_REASONS = ("queue_full", "would_miss_deadline", "rate_limit")

# Per-worker counters: exported name (without _total) -> (Stats field, help).
WORKER_COUNTERS: dict[str, tuple[str, str]] = {
    "prefix_cache_hit_tokens": ("prefix_cache_hits", "prompt tokens served from the prefix cache"),
    "prefix_cache_query_tokens": ("prefix_cache_queries",
                                  "prompt tokens looked up in the prefix cache"),
    "preemptions": ("preemptions", "sequences preempted (blocks freed, recomputed later)"),
    "worker_generated_tokens": ("generated_tokens",
                                "tokens the worker sampled, including those sampled after a "
                                "cancel or past a stop string that no client received"),
    "worker_prompt_tokens": ("prompt_tokens", "prompt tokens of the requests the worker took"),
    "spec_decode_proposed_tokens": ("spec_proposed_tokens",
                                    "draft tokens proposed by speculative decoding (0 while it "
                                    "is off)"),
    "spec_decode_accepted_tokens": ("spec_accepted_tokens",
                                    "draft tokens accepted by speculative decoding (0 while it "
                                    "is off)"),
    "spec_decode_verify_steps": ("spec_verify_steps",
                                 "sequence-steps that verified drafts; accepted tokens over "
                                 "these is the mean accepted length per step"),
    "idle_check_failures": ("idle_check_failures",
                            "times the worker went idle with KV blocks, sequences or grammar "
                            "state still held by no request (a leak; logged)"),
}


class WorkerView(Protocol):
    """What the collector reads of a worker (gateway.engine.registry.WorkerState)."""

    name: str  # the gateway's opaque "w<index>", never the worker's own id
    stats: m.Stats


class WorkerCollector(Collector):
    """Exports the connected workers' latest Stats. A worker that leaves leaves no series behind
    (only the workers connected now are listed); a restarted worker is a new id, a new series."""

    def __init__(self, workers: Callable[[], Sequence[WorkerView]]) -> None:
        self._workers = workers
        # Highest value seen per (worker id, counter), so a counter never goes down even if a
        # worker's reports arrive out of order; pruned to the connected workers at each scrape.
        self._high: dict[str, dict[str, float]] = {}

    @staticmethod
    def _families() -> tuple[list[GaugeMetricFamily], dict[str, CounterMetricFamily]]:
        label = ["worker"]
        gauges = [
            GaugeMetricFamily(f"{NS}_worker_running_sequences",
                              "sequences in the worker's running batch", labels=label),
            GaugeMetricFamily(f"{NS}_worker_waiting_sequences",
                              "sequences waiting for a place in the worker's batch",
                              labels=label),
            GaugeMetricFamily(f"{NS}_worker_kv_cache_usage_ratio",
                              "fraction of the worker's KV cache blocks in use (0 to 1)",
                              labels=label),
        ]
        counters = {name: CounterMetricFamily(f"{NS}_{name}", text, labels=label)
                    for name, (_, text) in WORKER_COUNTERS.items()}
        return gauges, counters

    @staticmethod
    def _step_families() -> list[Metric]:
        """The worker's step sizing (engine_worker.step_costs): what its steps took, how many
        prompt rows they carried, and the measured costs the sizing and admission read."""
        label = ["worker"]
        return [
            HistogramMetricFamily(f"{NS}_worker_step_seconds", "engine step wall time",
                                  labels=label),
            HistogramMetricFamily(f"{NS}_worker_step_prefill_tokens",
                                  "prompt rows (tokens) an engine step computed (0: decode "
                                  "only)", labels=label),
            GaugeMetricFamily(f"{NS}_worker_decode_step_cost_seconds",
                              "measured seconds of a decode-only step, by its decode rows",
                              labels=[*label, "rows"]),
            GaugeMetricFamily(f"{NS}_worker_prefill_row_cost_seconds",
                              "measured seconds a prompt row adds to a step, by the step's "
                              "prompt rows (bucket)", labels=[*label, "rows"]),
        ]

    def describe(self) -> Iterator[Metric]:
        # The names, so the registry refuses a clash at register time.
        gauges, counters = self._families()
        yield from gauges
        yield from counters.values()
        yield from self._step_families()

    def collect(self) -> Iterator[Metric]:
        (running, waiting, kv), counters = self._families()
        high: dict[str, dict[str, float]] = {}
        for w in self._workers():
            wid, s = w.name, w.stats  # a bounded label: the registry caps how many
            running.add_metric([wid], s.running)
            waiting.add_metric([wid], s.waiting)
            kv.add_metric([wid], s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total
                          else 0.0)
            seen = high[wid] = self._high.get(wid, {})
            for name, (fld, _) in WORKER_COUNTERS.items():
                seen[name] = max(seen.get(name, 0.0), float(getattr(s, fld)))
                counters[name].add_metric([wid], seen[name])
        self._high = high
        yield from (running, waiting, kv)
        yield from counters.values()
        yield from self._collect_steps()

    def _collect_steps(self) -> Iterator[Metric]:
        step_s, rows, decode, prefill = self._step_families()
        for w in self._workers():
            costs = w.stats.step_costs
            if costs is None:
                continue
            for family, hist, total in ((step_s, costs.step_seconds, costs.step_seconds_sum),
                                        (rows, costs.prefill_rows, costs.prefill_rows_sum)):
                if hist:
                    family.add_metric([w.name], [(_le(edge), float(n)) for edge, n in hist],
                                      total)
            for r, secs in costs.decode_s:
                decode.add_metric([w.name, str(round(r))], secs)
            for r, secs in costs.prefill_row_s:
                prefill.add_metric([w.name, str(r)], secs)
        yield from (step_s, rows, decode, prefill)


def _le(edge: float) -> str:
    return "+Inf" if edge == float("inf") else repr(float(edge))


class Metrics:
    def __init__(self, workers: Callable[[], Sequence[WorkerView]]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{NS}_requests", "requests ended, by route, HTTP status sent and finish reason "
            "(stop, length, aborted, timeout, rejected, error)",
            ["route", "status", "finish_reason"], registry=r)
        for route in ROUTES:  # so that rate() sees the first one of each (dashboards)
            self.requests.labels(route, "200", "stop")
            self.requests.labels(route, "200", "length")
            self.requests.labels(route, "429", "rejected")

        def latency(name: str, text: str) -> Histogram:
            return Histogram(f"{NS}_{name}_seconds", text, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = latency("time_to_first_token", "arrival at the gateway to the first token, "
                            "every request that produced one, streamed or not")
        self.itl = latency("inter_token_latency", "gap between consecutive token events of one "
                           "choice (one token each, unless speculative decoding sends several or "
                           "a stream that fell behind takes its queued frames as one)")
        self.tpot = latency("time_per_output_token",
                            "per request: first to last token over the tokens after the first")
        self.e2e = latency("e2e_request_latency",
                           "arrival to end, requests admitted and sent to a worker")
        self.queue_wait = latency(
            "queue_wait", "arrival at the gateway to first scheduled by a worker's engine: time "
            "to first token less the worker's first-scheduled-to-first-token time (sent on the "
            "first token frame); includes the gateway queue, the hop to the worker and its "
            "queue; requests that produced a token")
        self.prompt_len = Histogram(f"{NS}_request_prompt_tokens",
                                    "prompt length of requests sent to a worker",
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.gen_len = Histogram(f"{NS}_request_generation_tokens",
                                 "tokens a request received, all choices", buckets=TOKEN_BUCKETS,
                                 registry=r)
        self.prompt_tokens = Counter(f"{NS}_prompt_tokens",
                                     "prompt tokens of the requests sent to workers (the sum of "
                                     "their usage.prompt_tokens)", registry=r)
        self.generation_tokens = Counter(f"{NS}_generation_tokens",
                                         "tokens requests received from workers, aborted and "
                                         "timed-out ones' included (the sum of their "
                                         "usage.completion_tokens)", registry=r)
        self.waiting = Gauge(f"{NS}_requests_waiting",
                             "requests admitted to the gateway's queue, waiting for a place",
                             registry=r)
        self.in_flight = Gauge(f"{NS}_requests_in_flight",
                               "requests holding a place: sent to a worker or about to be",
                               registry=r)
        self.workers_ready = Gauge(f"{NS}_workers_ready", "workers ready for work", registry=r)
        self.rejections = Counter(
            f"{NS}_rejections", "requests answered 429, by reason: queue_full (the queue is at "
            "its cap), would_miss_deadline (the queue drains too slowly for the request's "
            "deadline), rate_limit (the client's own limit)", ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.rejections.labels(reason)
        self.expected_wait = Gauge(
            f"{NS}_admission_expected_wait_seconds", "expected queue wait of a request arriving "
            "now: (queued + 1) / drain rate, 0 with a free slot, NaN before a rate is measured",
            registry=r)
        self.drain_rate = Gauge(
            f"{NS}_admission_drain_rate", "slots the ready workers freed per second lately "
            "(requests a worker ran; summed over the workers)", registry=r)
        self.service_time = Gauge(
            f"{NS}_admission_service_seconds", "how long a request held its slot lately (EWMA), "
            "added to the expected wait when admission checks a deadline", registry=r)
        self.loop_lag = latency("event_loop_lag", "how late the gateway's event loop ran a timer "
                                "due every 100 ms: time it spent on something that blocked it")
        r.register(WorkerCollector(workers))

    def render(self) -> bytes:
        return generate_latest(self.registry)
