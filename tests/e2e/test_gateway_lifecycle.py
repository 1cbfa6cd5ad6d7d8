"""A request's life when its client, its worker or the gateway goes away, with real processes.

- Clients that drop streams: the worker samples at most one more token for each after its cancel
  arrives, and the gateway's in-flight count and the worker's KV usage return to idle.
- Clients that leave while queued are covered in test_gateway_failures (its server has a queue).
- SIGTERM to the gateway or to a worker: in-flight streams finish, new requests get 503 (or a
  refused connection once the gateway's listener is closed), the process exits 0. Past the
  gateway's drain timeout, streams still running end with an error event and [DONE].
- kill -9 of a worker: its streams end with an error event within 2 s, ready turns 503 (live stays
  200), and a restarted worker is used again by the same gateway. A hung worker (SIGSTOP) is
  dropped after the heartbeat timeout, and rejoins when it wakes.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import GatewayProc, WorkerProc, throttled

# One torch thread per worker: on a small shared machine more threads only contend (tests run
# about twice as fast under load).
ONE_THREAD = ("--threads", "1")

ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/generate/stream"]


def long_body(tokens: int, stream: bool = True) -> dict[str, Any]:
    """A body every generation route accepts, generating exactly `tokens` tokens."""
    return {"prompt": "Once upon a time", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": tokens, "max_new_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProc]:
    """One gateway for the tests that start (and kill) their own workers. A long default deadline:
    the streams here must end by finishing or failing, never by timing out on a slow machine."""
    with GatewayProc("--default-timeout-s", "120") as gw:
        gw.wait_live()
        yield gw


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def status(gw: GatewayProc, path: str) -> int:
    return httpx.get(gw.base_url + path, timeout=5).status_code


class Stream(threading.Thread):
    """One streamed request read on its own thread: when its first token event came, every line, and
    when it ended."""

    def __init__(self, gw: GatewayProc, route: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = gw.base_url + route, body
        self.first = threading.Event()
        self.lines: list[str] = []
        self.status = 0
        self.ended_at = 0.0

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=60) as resp:
            self.status = resp.status_code
            for line in resp.iter_lines():
                if line:
                    self.lines.append(line)
                    if '"role"' not in line:  # chat's role chunk comes before any token
                        self.first.set()
        self.ended_at = time.monotonic()
        self.first.set()

    def events(self) -> list[dict[str, Any]]:
        assert self.lines and self.lines[-1] == "data: [DONE]", self.lines[-3:]
        return [json.loads(line.removeprefix("data: ")) for line in self.lines[:-1]]


def start_streams(gw: GatewayProc, n: int, tokens: int) -> list[Stream]:
    streams = [Stream(gw, ROUTES[i % len(ROUTES)], long_body(tokens)) for i in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(30) and s.status == 200, (s.status, s.lines)
    return streams


def finish_reason(event: dict[str, Any]) -> str | None:
    return event["choices"][0]["finish_reason"] if "choices" in event else \
        event.get("finish_reason")


# ---- clients that leave ------------------------------------------------------------------------

def raw_request(port: int, route: str, body: dict[str, Any], request_id: str) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"X-Request-ID: %s\r\nContent-Length: %d\r\n\r\n%s"
                 % (route.encode(), request_id.encode(), len(data), data))
    return sock


def idle(gw: GatewayProc) -> bool:
    queue = httpx.get(gw.base_url + "/health", timeout=5).json()["queue"]
    text = gw.metrics()
    in_flight = float(re.search(r"^kestrel_requests_in_flight (\S+)$", text, re.M).group(1))
    kv = [float(v) for v in re.findall(r"^kestrel_worker_kv_cache_usage_ratio\{.*\} (\S+)$",
                                       text, re.M)]
    return queue["outstanding"] == 0 and queue["waiting"] == 0 and in_flight == 0 and kv == [0.0]


def test_twenty_dropped_streams_stop_within_a_step_and_free_everything(
        gateway: GatewayProc, tiny_model_dir: Path) -> None:
    gw = gateway
    with WorkerProc(tiny_model_dir, gw.engine_address, *ONE_THREAD) as wk:
        gw.wait_ready()
        wait_for(lambda: idle(gw), 5, "an idle worker")
        ids = [f"drop-{i}" for i in range(20)]
        socks = [raw_request(gw.port, ROUTES[i % 3], long_body(1000), rid)
                 for i, rid in enumerate(ids)]
        # Two non-streamed requests too: their clients leave while waiting for the answer.
        waiting = [raw_request(gw.port, route, long_body(1000, stream=False), f"drop-ns-{i}")
                   for i, route in enumerate(["/v1/completions", "/v1/generate"])]
        for sock in socks:
            received = b""
            while received.count(b"data: ") < 3:
                chunk = sock.recv(4096)
                assert chunk, received
                received += chunk
            sock.close()
        for sock in waiting:
            sock.close()
        ids += ["drop-ns-0", "drop-ns-1"]

        def engine_ids() -> dict[str, str]:
            return {e["request_id"]: e["engine_request_id"] for e in gw.log_lines()
                    if e.get("event") == "request_end" and e["request_id"] in ids}

        wait_for(lambda: len(engine_ids()) == len(ids), 10, "the gateway to end all requests")
        rids = set(engine_ids().values())
        wait_for(lambda: rids <= set(wk.request_ends()), 10, "the worker to end all requests")
        ends = {rid: e for rid, e in wk.request_ends().items() if rid in rids}
        for end in ends.values():
            assert end["finish_reasons"] == ["abort"], end
            assert "cancel_received_ts" in end, end
            assert end["tokens_after_cancel"] <= 1, end
        assert all(e["status"] == 499 or e["finish_reason"] == "aborted"
                   for e in gw.log_lines() if e.get("request_id") in ids)
        # Heartbeats carry the worker's stats every 0.25 s: give them a moment.
        wait_for(lambda: idle(gw), 3, "in-flight requests and KV usage back to zero")


# ---- SIGTERM --------------------------------------------------------------------------------

def half_sent(port: int, head: bytes) -> socket.socket:
    """A request whose last bytes are still to come: it reaches the app only when they do."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head)
    return sock


def response_of(sock: socket.socket, rest: bytes) -> tuple[int, str]:
    sock.sendall(rest)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def test_sigterm_lets_streams_finish_refuses_new_work_and_exits_0(
        tiny_model_dir: Path) -> None:
    with GatewayProc("--drain-timeout-s", "60", "--default-timeout-s", "120") as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address, *ONE_THREAD) as wk:
        gw.wait_ready()
        body = json.dumps(long_body(5, stream=False)).encode()
        # A request still uploading its body at SIGTERM: it is past the first check (its handler
        # started) but must still be refused.
        # (Connection: close: the server stays up through the drain, so the answer's end is
        # the connection's end only if the client asks for that.)
        late_post = half_sent(gw.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                       b"Connection: close\r\n"
                                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:5]))
        time.sleep(0.1)
        # 400 tokens (~1 s on the tiny model): the drain must still be running when the checks
        # below begin, with another test process beside this one (100 ended first once).
        streams = start_streams(gw, 3, tokens=400)
        gw.signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.05)
        code, text = response_of(late_post, body[5:])
        assert code == 503 and json.loads(text)["error"]["code"] == "shutting_down", text
        answered = 0
        while any(s.is_alive() for s in streams):
            # New connections are answered 503 while the drain runs, never refused (issue 23):
            # a load balancer must tell draining from dead.
            start = time.monotonic()
            try:
                resp = httpx.post(gw.base_url + "/v1/completions", timeout=5,
                                  json=long_body(2, stream=False))
                took = time.monotonic() - start
                ready = status(gw, "/health/ready")
            except (httpx.ConnectError, httpx.ReadError):
                # only once the streams' last tokens have gone out: the port closes as the drain
                # ends (a connection made at that moment is reset, not answered; each stream
                # is checked below to have finished whole)
                break
            assert resp.status_code == 503, resp.text
            assert took < 1.0
            assert ready == 503
            answered += 1
            time.sleep(0.05)
        assert answered >= 1, answered  # the port answered while the streams ran on
        for s in streams:
            s.join(60)
            events = s.events()
            assert finish_reason(events[-1]) == "length"
            assert s.ended_at > signalled  # it was still streaming during the drain
        assert gw.popen is not None and gw.popen.wait(30) == 0, gw.output()[-3000:]
        assert wk.popen is not None and wk.popen.poll() is None


def test_past_the_drain_timeout_streams_end_with_an_error_event_and_it_exits_0(
        tiny_model_dir: Path) -> None:
    with GatewayProc("--drain-timeout-s", "1", "--max-outstanding", "2",
                     "--default-timeout-s", "120") as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address, *ONE_THREAD) as wk:
        gw.wait_ready()
        streams = start_streams(gw, 2, tokens=1000)
        queued: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: queued.append(httpx.post(
            gw.base_url + "/v1/completions", json=long_body(5, stream=False), timeout=30)),
            daemon=True)
        waiter.start()
        wait_for(lambda: httpx.get(gw.base_url + "/health").json()["queue"]["waiting"] == 1,
                 10, "a queued request")
        # The tiny model makes 1,000 tokens in about a second on a fast host: slowed to a tenth
        # of its pace, the streams are sure to be running still when the drain timeout passes.
        with throttled(wk):
            gw.signal(signal.SIGTERM)
            signalled = time.monotonic()
            waiter.join(5)
            assert queued[0].status_code == 503, queued[0].text  # queued, never admitted
            assert queued[0].json()["error"]["code"] == "shutting_down"
            for s in streams:
                s.join(10)
                assert 0.9 < s.ended_at - signalled < 2.5
                error = s.events()[-1]["error"]  # an error event, then [DONE]
                assert error["code"] == "shutting_down" and error["type"] == "service_unavailable"
        assert gw.popen is not None and gw.popen.wait(10) == 0, gw.output()[-3000:]
        rids = [e["engine_request_id"] for e in gw.log_lines()
                if e.get("event") == "request_end" and e.get("engine_request_id")]
        wait_for(lambda: set(rids) <= set(wk.request_ends()), 5, "the worker to stop them")
        assert all(wk.request_ends()[r]["finish_reasons"] == ["abort"] for r in rids)
        assert "Traceback" not in gw.output()


def test_worker_sigterm_finishes_its_streams_refuses_new_work_and_exits_0(
        gateway: GatewayProc, tiny_model_dir: Path) -> None:
    gw = gateway
    wk = WorkerProc(tiny_model_dir, gw.engine_address, *ONE_THREAD,
                    "--drain-timeout-s", "60").start()
    try:
        gw.wait_ready()
        streams = start_streams(gw, 3, tokens=100)
        wk.signal(signal.SIGTERM)
        signalled = time.monotonic()
        while any(s.is_alive() for s in streams):  # refused at once, not queued
            start = time.monotonic()
            resp = httpx.post(gw.base_url + "/v1/completions", json=long_body(2, stream=False),
                              timeout=10)
            assert resp.status_code == 503, resp.text
            assert time.monotonic() - start < 1.0
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
            time.sleep(0.05)
        for s in streams:
            s.join(60)
            assert finish_reason(s.events()[-1]) == "length"
            assert s.ended_at > signalled
        assert wk.popen is not None and wk.popen.wait(30) == 0, wk.output()[-3000:]
        wait_for(lambda: status(gw, "/health/ready") == 503, 5, "ready to turn 503")
        assert status(gw, "/health/live") == 200
    finally:
        wk.stop()


# ---- kill -9 of a worker --------------------------------------------------------------------

def test_killed_worker_fails_its_requests_within_2s_and_a_new_one_is_used(
        gateway: GatewayProc, tiny_model_dir: Path) -> None:
    gw = gateway
    first = WorkerProc(tiny_model_dir, gw.engine_address, *ONE_THREAD).start()
    try:
        gw.wait_ready()
        streams = start_streams(gw, 3, tokens=1000)
        answers: list[tuple[httpx.Response, float]] = []
        collect = threading.Thread(target=lambda: answers.append((httpx.post(
            gw.base_url + "/v1/completions", json=long_body(1000, stream=False), timeout=60),
            time.monotonic())), daemon=True)
        collect.start()
        wait_for(lambda: httpx.get(gw.base_url + "/health").json()["queue"]["outstanding"] == 4,
                 10, "four requests at the worker")
        killed = time.monotonic()
        first.kill()
        for s in streams:
            s.join(10)
            assert s.ended_at - killed < 2.0, s.ended_at - killed
            error = s.events()[-1]["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "worker_lost"
        collect.join(10)
        resp, at = answers[0]
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "worker_lost"
        assert at - killed < 2.0
        assert status(gw, "/health/ready") == 503
        assert status(gw, "/health/live") == 200
    finally:
        first.kill()
    with WorkerProc(tiny_model_dir, gw.engine_address, *ONE_THREAD):
        gw.wait_ready()
        resp = httpx.post(gw.base_url + "/v1/completions", json=long_body(3, stream=False),
                          timeout=30)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


def test_a_silent_worker_is_dropped_and_rejoins_when_it_wakes_up(
        gateway: GatewayProc, tiny_model_dir: Path) -> None:
    """A hung worker (SIGSTOP) says nothing and keeps its connection: the heartbeat timeout
    (1.5 s by default) finds it. Woken up, it is asked to say Hello again and is used again."""
    gw = gateway
    wk = WorkerProc(tiny_model_dir, gw.engine_address, *ONE_THREAD).start()
    try:
        gw.wait_ready()
        streams = start_streams(gw, 2, tokens=1000)
        stopped = time.monotonic()
        wk.signal(signal.SIGSTOP)
        for s in streams:
            s.join(10)
            assert s.ended_at - stopped < 2.5, s.ended_at - stopped
            assert s.events()[-1]["error"]["code"] == "worker_lost"
        assert status(gw, "/health/ready") == 503
        wk.signal(signal.SIGCONT)
        gw.wait_ready(timeout=30)
        resp = httpx.post(gw.base_url + "/v1/completions", json=long_body(3, stream=False),
                          timeout=30)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    finally:
        wk.signal(signal.SIGCONT)
        wk.stop()
