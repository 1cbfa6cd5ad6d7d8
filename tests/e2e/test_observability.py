"""Observability with real processes: /metrics moves by exactly what the requests did, every
final answer carries `timings`, every request ends with one JSON log line, and X-Request-ID is
echoed (or made) on every generation route, errors and streams included.

- tiny_server: a concurrent batch over the four generation routes (streamed and not, n = 1 and 2,
  no stop strings), then 4xx errors.
- `single`: a gateway that takes one request at a time and queues none, so a second one is
  rejected at once; a cancel, a 429 and a timeout each move their finish reason by exactly 1, the
  gauges return to idle after the disconnect, and a killed worker leaves no series behind.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.procs import GatewayProc, WorkerProc, decode_step_s, throttled

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
         "generate": "/v1/generate", "generate_stream": "/v1/generate/stream"}
TIMING_KEYS = {"ttft_ms", "tpot_ms", "tokens_per_s"}
HEX_ID = re.compile(r"^[0-9a-f]{32}$")


def body(route: str, tokens: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    if route.startswith("generate"):
        return {"prompt": "Once upon a time", "max_new_tokens": tokens, "ignore_eos": True,
                "temperature": 0, **extra}
    b: dict[str, Any] = {"max_tokens": tokens, "ignore_eos": True, "temperature": 0,
                         "stream": stream, **extra}
    if route == "chat":
        return {**b, "messages": [{"role": "user", "content": "Tell me a story"}]}
    return {**b, "prompt": "Once upon a time"}


def scrape(gw: GatewayProc) -> list[Sample]:
    return [s for fam in text_string_to_metric_families(gw.metrics()) for s in fam.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


def request_ends(gw: GatewayProc) -> dict[str, dict[str, Any]]:
    return {e["request_id"]: e for e in gw.log_lines() if e.get("event") == "request_end"}


def call(gw: GatewayProc, route: str, payload: dict[str, Any],
         request_id: str | None = None) -> dict[str, Any]:
    """One request; its status, echoed id, usage (prompt, completion) and final `timings`."""
    headers = {"X-Request-ID": request_id} if request_id else {}
    url, streamed = gw.base_url + PATHS[route], route == "generate_stream" or payload.get("stream")
    if streamed:
        with httpx.stream("POST", url, json=payload, headers=headers, timeout=30) as resp:
            lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]", lines[-3:]
        final = json.loads(lines[-2])  # the stream's final chunk
    else:
        resp = httpx.post(url, json=payload, headers=headers, timeout=30)
        final = resp.json()
    counts = final.get("usage") or final
    return {"route": route, "status": resp.status_code, "id": resp.headers.get("x-request-id"),
            "usage": (counts["prompt_tokens"], counts["completion_tokens"]),
            "timings": final.get("timings"), "n": payload.get("n", 1)}


# ---- a batch of completed requests --------------------------------------------------------------

BATCH: list[tuple[str, dict[str, Any], str | None]] = [
    ("completions", body("completions", 6), "obs-0"),
    ("completions", body("completions", 7, stream=True), None),
    ("chat", body("chat", 5, n=2), "obs-2"),
    ("chat", body("chat", 8, stream=True, stream_options={"include_usage": True}), None),
    ("chat", body("chat", 6, stream=True, n=2), "obs-4"),
    ("generate", body("generate", 9), "obs-5"),
    ("generate_stream", body("generate_stream", 10), None),
    ("completions", body("completions", 4, stream=True), "obs-7"),
]


def test_a_batch_moves_the_metrics_by_what_it_did(tiny_server: Any) -> None:
    gw, _ = tiny_server
    before = scrape(gw)
    with ThreadPoolExecutor(len(BATCH)) as pool:
        results = list(pool.map(lambda job: call(gw, *job), BATCH))
    after = scrape(gw)

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert all(r["status"] == 200 for r in results)
    for r, (_, _, rid) in zip(results, BATCH, strict=True):  # the client's id, else a new one
        assert r["id"] == rid if rid else HEX_ID.match(r["id"]), r
        assert set(r["timings"]) == TIMING_KEYS and r["timings"]["ttft_ms"] > 0, r
        assert r["timings"]["tokens_per_s"] > 0 and r["timings"]["tpot_ms"] > 0, r
    n, prompt = len(BATCH), sum(r["usage"][0] for r in results)
    completion = sum(r["usage"][1] for r in results)
    assert moved("kestrel_prompt_tokens_total") == prompt
    assert moved("kestrel_generation_tokens_total") == completion
    assert moved("kestrel_request_prompt_tokens_sum") == prompt
    assert moved("kestrel_request_generation_tokens_sum") == completion
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency",
                 "queue_wait"):
        assert moved(f"kestrel_{name}_seconds_count") == n, name
    # One gap per token event after each choice's first: one per token, less the frames the
    # route joined when it fell behind the worker (two cores and eight clients: it happens).
    gaps = moved("kestrel_inter_token_latency_seconds_count")
    assert 0 < gaps <= completion - sum(r["n"] for r in results)
    for route in PATHS:
        assert moved("kestrel_requests_total", route=route, status="200") == \
            sum(r["route"] == route for r in results), route
    assert moved("kestrel_requests_total") == n
    assert total(after, "kestrel_workers_ready") == 1
    [worker] = {s.labels["worker"] for s in after if s.name == "kestrel_worker_running_sequences"}

    ends = request_ends(gw)
    for r in results:
        line = ends[r["id"]]
        assert (line["route"], line["status"]) == (r["route"], 200)
        assert (line["tokens_in"], line["tokens_out"]) == r["usage"]
        assert line["finish_reason"] == "length" and line["worker"] == worker
        assert 0 <= line["queue_wait_ms"] <= line["ttft_ms"] <= line["total_ms"]
        # The worker's own wait comes on top of the gateway's (rounding aside).
        assert line["gateway_wait_ms"] <= line["queue_wait_ms"] + 0.02


def test_errors_carry_the_request_id_and_are_counted_and_logged(tiny_server: Any) -> None:
    gw, _ = tiny_server
    before = scrape(gw)
    bad = {"completions": {"prompt": "x", "max_tokens": 0, "stream": True},
           "chat": {"messages": [], "stream": True},
           "generate": {"prompt": 3},
           "generate_stream": {"prompt": "x", "max_new_tokens": -1}}
    for route, payload in bad.items():
        resp = httpx.post(gw.base_url + PATHS[route], json=payload,
                          headers={"X-Request-ID": f"bad-{route}"}, timeout=10)
        assert resp.status_code == 422 and resp.headers["x-request-id"] == f"bad-{route}"
    unknown = httpx.post(gw.base_url + PATHS["chat"], json=body("chat", 3, model="nope"))
    assert unknown.status_code == 404 and HEX_ID.match(unknown.headers["x-request-id"])
    after = scrape(gw)
    moved = total(after, "kestrel_requests_total", status="422", finish_reason="error") - \
        total(before, "kestrel_requests_total", status="422", finish_reason="error")
    assert moved == 4
    ends = request_ends(gw)
    for route in bad:
        line = ends[f"bad-{route}"]
        assert (line["route"], line["status"], line["finish_reason"]) == (route, 422, "error")
        assert line["tokens_in"] is None and line["total_ms"] >= 0
    assert ends[unknown.headers["x-request-id"]]["status"] == 404


# ---- the exits: aborted, rejected, timed out, worker lost ---------------------------------------

def test_every_response_carries_a_request_id(tiny_server: Any) -> None:
    gw, _ = tiny_server
    for method, path in [("GET", "/health"), ("GET", "/health/live"), ("GET", "/v1/models"),
                         ("GET", "/metrics"), ("GET", "/no/such/route"),
                         ("DELETE", "/v1/completions")]:
        given = httpx.request(method, gw.base_url + path, headers={"X-Request-ID": "rid-42"})
        assert given.headers["x-request-id"] == "rid-42", path
        made = httpx.request(method, gw.base_url + path)
        assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"]), path


@pytest.fixture(scope="module")
def single(tiny_model_dir: Path) -> Iterator[tuple[GatewayProc, WorkerProc]]:
    with GatewayProc("--max-outstanding", "1", "--max-queue", "0") as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1") as wk:
        gw.wait_ready()
        yield gw, wk


def open_stream(gw: GatewayProc, route: str, request_id: str) -> socket.socket:
    """A long stream on a raw socket (to be dropped), once its first events have come."""
    data = json.dumps(body(route, 1000, stream=True)).encode()
    sock = socket.create_connection(("127.0.0.1", gw.port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"X-Request-ID: %s\r\nContent-Length: %d\r\n\r\n%s"
                 % (PATHS[route].encode(), request_id.encode(), len(data), data))
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(4096)
    assert b"x-request-id: " + request_id.encode() in received.lower()
    return sock


def gauges(gw: GatewayProc) -> tuple[float, float, float, float]:
    s = scrape(gw)
    return (total(s, "kestrel_requests_in_flight"), total(s, "kestrel_requests_waiting"),
            total(s, "kestrel_worker_running_sequences"),
            total(s, "kestrel_worker_kv_cache_usage_ratio"))


def test_abort_reject_and_timeout_each_count_once(single: Any) -> None:
    gw, wk = single
    before = scrape(gw)
    stream = open_stream(gw, "chat", "obs-aborted")
    in_flight, _, running, kv = wait_for(lambda: (g := gauges(gw))[2] and g, 2, "worker stats")
    assert in_flight == 1 and running == 1 and kv > 0

    rejected = httpx.post(gw.base_url + PATHS["completions"], json=body("completions", 5),
                          headers={"X-Request-ID": "obs-rejected"}, timeout=10)
    assert rejected.status_code == 429 and rejected.headers["x-request-id"] == "obs-rejected"
    assert gauges(gw)[:2] == (1, 0)  # a rejection holds no place and waits nowhere

    stream.close()  # the client leaves mid-stream: everything returns to idle
    wait_for(lambda: gauges(gw) == (0, 0, 0, 0), 5, "idle gauges after the disconnect")

    # Admitted because it fits 0.3 s by the worker's measured costs; run 10x slower than that
    # (throttled), it misses: a timeout with tokens sent.
    fits = max(2, int(0.15 / decode_step_s(gw)))
    with throttled(wk):
        timed_out = httpx.post(gw.base_url + PATHS["generate"],
                               json=body("generate", fits, timeout=0.3),
                               headers={"X-Request-ID": "obs-timeout"}, timeout=10)
    assert timed_out.status_code == 504 and timed_out.headers["x-request-id"] == "obs-timeout"

    ends = wait_for(lambda: (e := request_ends(gw)).keys() >= {"obs-aborted", "obs-timeout"}
                    and e, 5, "the log lines")
    after = scrape(gw)

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    for reason in ("aborted", "rejected", "timeout"):
        assert moved("kestrel_requests_total", finish_reason=reason) == 1, reason
    assert moved("kestrel_requests_total") == 3
    expected = {"obs-aborted": ("chat", 200, "aborted"),
                "obs-rejected": ("completions", 429, "rejected"),
                "obs-timeout": ("generate", 504, "timeout")}
    for rid, fields in expected.items():
        assert (ends[rid]["route"], ends[rid]["status"], ends[rid]["finish_reason"]) == fields
    assert ends["obs-rejected"]["tokens_in"] is None
    # Aborted and timed-out requests' tokens count too: the counters equal the logged usage.
    sent = [ends["obs-aborted"], ends["obs-timeout"]]
    assert all(e["tokens_out"] > 0 for e in sent)
    assert moved("kestrel_generation_tokens_total") == sum(e["tokens_out"] for e in sent)
    assert moved("kestrel_prompt_tokens_total") == sum(e["tokens_in"] for e in sent)
    assert moved("kestrel_time_to_first_token_seconds_count") == 2


def test_a_lost_worker_is_logged_and_leaves_no_series(single: Any) -> None:
    gw, wk = single
    [worker] = [w["id"] for w in httpx.get(gw.base_url + "/health").json()["workers"]]
    before = scrape(gw)
    assert any(s.labels.get("worker") == worker for s in before)
    url = gw.base_url + PATHS["generate_stream"]
    with httpx.stream("POST", url, json=body("generate_stream", 1000),
                      headers={"X-Request-ID": "obs-lost"}, timeout=30) as resp:
        lines = resp.iter_lines()
        next(ln for ln in lines if ln.startswith("data: "))
        wk.kill()
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert resp.headers["x-request-id"] == "obs-lost"
    assert rest[-1] == "data: [DONE]" and "worker_lost" in rest[-2]
    line = wait_for(lambda: request_ends(gw).get("obs-lost"), 5, "the log line")
    assert (line["status"], line["finish_reason"], line["worker"]) == (503, "error", worker)
    after = scrape(gw)
    assert not any(s.labels.get("worker") == worker for s in after)
    assert total(after, "kestrel_workers_ready") == 0
    assert total(after, "kestrel_requests_total", status="503", finish_reason="error") - \
        total(before, "kestrel_requests_total", status="503", finish_reason="error") == 1
