"""gateway/telemetry/metrics.py and what feeds it (Timings, Accounting.record), with no processes:
worker series carry a `worker` label and vanish with their worker, worker counters never go down,
timings are measured per choice, and every exit path of a request is counted and logged once."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig
from gateway.output.timings import Timings
from gateway.service import GatewayState
from gateway.telemetry.metrics import LATENCY_BUCKETS, Metrics
from protocol import messages as m


@dataclass
class FakeWorker:
    worker_id: str
    stats: m.Stats = field(default_factory=m.Stats)

    @property
    def name(self) -> str:  # the gateway's opaque name for a worker: the metric label
        return self.worker_id


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape, parsed as Prometheus would."""
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def by_worker(scrape: dict, name: str) -> dict[str, float]:
    return {dict(labels)["worker"]: v for (n, labels), v in scrape.items() if n == name}


def test_worker_series_carry_the_worker_label_and_stats() -> None:
    workers = [FakeWorker("a" * 32, m.Stats(running=3, waiting=2, kv_blocks_used=5,
                                            kv_blocks_total=20, prefix_cache_hits=16,
                                            prefix_cache_queries=64, preemptions=1,
                                            generated_tokens=100, prompt_tokens=70)),
               FakeWorker("b" * 32)]
    scrape = samples(Metrics(lambda: workers))
    a, b = "a" * 32, "b" * 32
    assert by_worker(scrape, "kestrel_worker_running_sequences") == {a: 3, b: 0}
    assert by_worker(scrape, "kestrel_worker_waiting_sequences") == {a: 2, b: 0}
    assert by_worker(scrape, "kestrel_worker_kv_cache_usage_ratio") == {a: 0.25, b: 0.0}
    assert by_worker(scrape, "kestrel_prefix_cache_hit_tokens_total") == {a: 16, b: 0}
    assert by_worker(scrape, "kestrel_prefix_cache_query_tokens_total") == {a: 64, b: 0}
    assert by_worker(scrape, "kestrel_preemptions_total") == {a: 1, b: 0}
    assert by_worker(scrape, "kestrel_worker_generated_tokens_total") == {a: 100, b: 0}
    assert by_worker(scrape, "kestrel_worker_prompt_tokens_total") == {a: 70, b: 0}
    # Speculative decoding will feed these; until then they exist, at 0.
    assert by_worker(scrape, "kestrel_spec_decode_proposed_tokens_total") == {a: 0, b: 0}
    assert by_worker(scrape, "kestrel_spec_decode_accepted_tokens_total") == {a: 0, b: 0}


def test_a_worker_that_leaves_leaves_no_series_and_a_restarted_one_is_new() -> None:
    workers = [FakeWorker("old", m.Stats(running=1, generated_tokens=50)), FakeWorker("other")]
    metrics = Metrics(lambda: workers)
    assert "old" in by_worker(samples(metrics), "kestrel_worker_generated_tokens_total")
    workers[0] = FakeWorker("new", m.Stats(generated_tokens=2))  # the same host, restarted
    scrape = samples(metrics)
    assert not [k for k in scrape if ("worker", "old") in k[1]]
    assert by_worker(scrape, "kestrel_worker_generated_tokens_total") == {"new": 2, "other": 0}


def test_worker_counters_never_go_down() -> None:
    worker = FakeWorker("w", m.Stats(preemptions=4, generated_tokens=10, running=2))
    metrics = Metrics(lambda: [worker])
    samples(metrics)
    worker.stats = m.Stats(preemptions=3, generated_tokens=12, running=0)  # a stale report
    scrape = samples(metrics)
    assert by_worker(scrape, "kestrel_preemptions_total") == {"w": 4}
    assert by_worker(scrape, "kestrel_worker_generated_tokens_total") == {"w": 12}
    assert by_worker(scrape, "kestrel_worker_running_sequences") == {"w": 0}  # gauges follow


def test_one_namespace_units_in_names_and_buckets_from_1ms_to_60s() -> None:
    families = list(text_string_to_metric_families(Metrics(list).render().decode()))
    assert families and all(f.name.startswith("kestrel_") for f in families)
    for f in families:
        if f.type == "histogram":
            assert f.name.endswith(("_seconds", "_tokens")), f.name
            if f.name.startswith("kestrel_worker_"):
                continue  # a worker's own histograms, with its own edges (test_worker_steps)
            les = sorted({float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket")})
            if f.name.endswith("_seconds"):
                assert les[0] == 0.001 and les[-2] == 60.0 and les[-1] == float("inf")
    assert LATENCY_BUCKETS[0] == 0.001 and LATENCY_BUCKETS[-1] == 60.0
    names = {f.name for f in families}
    assert {"kestrel_requests_waiting", "kestrel_requests_in_flight", "kestrel_workers_ready",
            "kestrel_queue_wait_seconds", "kestrel_requests", "kestrel_generation_tokens"} <= names


# ---- Timings ------------------------------------------------------------------------------------

def test_gaps_are_within_a_choice_and_tpot_pools_the_choices() -> None:
    t = Timings(arrival=10.0)
    # n = 2: each step sends one frame per choice, a millisecond apart.
    for step in range(4):
        for index in (0, 1):
            t.on_tokens(index, 1, 11.0 + step * 0.1 + index * 0.001,
                        since_scheduled_s=0.25 if step == 0 and index == 0 else None)
    assert t.gaps == pytest.approx([0.1] * 6)
    assert t.tpot() == pytest.approx(0.1)
    assert t.first_token == 11.0 and t.last_token == pytest.approx(11.301)
    assert t.queue_wait == pytest.approx(0.75)  # ttft 1.0 less the worker's 0.25
    d = t.as_dict(completion_tokens=8)
    assert d["ttft_ms"] == 1000.0 and d["tpot_ms"] == pytest.approx(100.0)
    assert d["tokens_per_s"] == pytest.approx(8 / 1.301, rel=1e-3)


def test_one_token_has_no_tpot_and_no_worker_figure_no_queue_wait() -> None:
    t = Timings(arrival=0.0)
    t.on_tokens(0, 1, 0.5)
    assert t.gaps == [] and t.tpot() is None and t.queue_wait is None
    assert t.as_dict(1)["tpot_ms"] is None


# ---- record(): every exit counted and logged once ----------------------------------------------

@pytest.fixture
def state() -> Iterator[GatewayState]:
    st = GatewayState(GatewayConfig())
    yield st
    st.client.link.close()


def fake_gen(reasons: list[str | None], tokens: int = 3) -> Any:
    t = Timings(arrival=0.0)
    for i in range(tokens):
        t.on_tokens(0, 1, 0.1 * (i + 1), since_scheduled_s=0.04 if i == 0 else None)
    worker = SimpleNamespace(name="w1", hello=SimpleNamespace(worker_id="wid-1"),
                             stats=SimpleNamespace(running=1))
    return SimpleNamespace(timings=t, prompt_tokens=7, completion_tokens=tokens,
                           finish_reasons=reasons, request_id="eng-1",
                           handle=SimpleNamespace(worker=worker, peak_batch=1))


@pytest.mark.parametrize("status, gen, finish, expected", [
    (200, ["length"], None, "length"),
    (200, ["stop", "length"], None, "stop"),
    (200, [None], "aborted", "aborted"),  # a stream whose client left
    (200, ["abort"], None, "aborted"),  # the worker's word for it
    (200, ["timeout"], "timeout", "timeout"),
    (499, None, "aborted", "aborted"),
    (499, [None], None, "aborted"),
    (429, None, None, "rejected"),
    (504, None, None, "timeout"),  # the deadline passed in the queue
    (503, ["length", None], None, "error"),  # its worker was lost
    (422, None, None, "error"),
])
def test_record_counts_and_logs_every_exit(state: GatewayState, caplog: pytest.LogCaptureFixture,
                                           status: int, gen: list | None, finish: str | None,
                                           expected: str) -> None:
    g = None if gen is None else fake_gen(gen)
    with caplog.at_level(logging.INFO, logger="kestrel.gateway.requests"):
        state.accounting.record("chat", status, g, 0.0, "client-id", finish)
    scrape = samples(state.metrics)
    key = ("kestrel_requests_total", (("finish_reason", expected), ("route", "chat"),
                                      ("status", str(status))))
    assert scrape[key] == 1
    [line] = [r.fields for r in caplog.records if getattr(r, "fields", None)]  # type: ignore[attr-defined]
    assert line["request_id"] == "client-id" and line["status"] == status
    assert line["finish_reason"] == expected and line["route"] == "chat"
    assert line["total_ms"] >= 0
    for key_ in ("tokens_in", "tokens_out", "queue_wait_ms", "ttft_ms", "worker"):
        assert key_ in line
    admitted = g is not None
    assert scrape[("kestrel_e2e_request_latency_seconds_count", ())] == int(admitted)
    if admitted:
        assert (line["tokens_in"], line["tokens_out"], line["worker"]) == (7, 3, "w1")
        assert line["ttft_ms"] == 100.0 and line["queue_wait_ms"] == 60.0
        assert scrape[("kestrel_generation_tokens_total", ())] == 3
        assert scrape[("kestrel_prompt_tokens_total", ())] == 7
        assert scrape[("kestrel_inter_token_latency_seconds_count", ())] == 2
        assert scrape[("kestrel_time_to_first_token_seconds_count", ())] == 1
        assert scrape[("kestrel_queue_wait_seconds_sum", ())] == pytest.approx(0.06)
    else:
        assert line["tokens_in"] is None and line["worker"] is None
