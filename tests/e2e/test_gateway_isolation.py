"""Issue 23, end to end: a hostile chat template from a worker's Hello stalls nothing else.

A peer joins as the worker of model "evil" whose chat template loops without writing
(`{% for i in range(100000) %}{% for j in range(100000) %}...`). Seven chat requests for it
used to hold every tokenizing thread for hours: every later request to every model hung,
/health/live took up to 1.4 s and SIGTERM no longer ended the gateway. Now each render stops at
--template-timeout-s (a 400), the real model's requests are answered meanwhile, liveness stays
quick, and SIGTERM ends the gateway within its drain timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from protocol import codec
from protocol import messages as m
from tests.e2e.link_peers import FakeWorker, tiny_hello
from tests.procs import GatewayProc, WorkerProc, read_response

SILENT_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}")
TEMPLATE_TIMEOUT_S = 0.5
DRAIN_S = 2.0


@contextlib.contextmanager
def evil_peer(gw: GatewayProc, model_dir: Path, template: str,
              hello_timeout_s: float = 10.0) -> Iterator[float]:
    """A peer that joins as the worker of model "evil" with `template` as its chat template and
    keeps sending heartbeats; yields how long the gateway took to welcome it."""
    peer = FakeWorker(gw.engine_address)
    info = tiny_hello(model_dir).tokenizer
    hello = tiny_hello(model_dir, model_id="evil",
                       tokenizer=dataclasses.replace(info, chat_template=template))
    start = time.monotonic()
    assert peer.hello(hello, timeout_s=hello_timeout_s) is not None
    welcomed = time.monotonic() - start
    stop = threading.Event()

    def heartbeats() -> None:  # a live worker, as far as the gateway can tell
        while not stop.wait(0.2):
            peer.send(m.Heartbeat(hello.worker_id, m.Stats()))

    beat = threading.Thread(target=heartbeats, daemon=True)
    beat.start()
    try:
        yield welcomed
    finally:
        stop.set()
        beat.join()
        peer.close()


@pytest.fixture()
def evil_and_real(tiny_model_dir: Path) -> Iterator[tuple[GatewayProc, WorkerProc]]:
    with GatewayProc("--template-timeout-s", str(TEMPLATE_TIMEOUT_S),
                     "--drain-timeout-s", str(DRAIN_S)) as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1") as wk:
        gw.wait_ready()
        with evil_peer(gw, tiny_model_dir, SILENT_LOOPS):
            yield gw, wk


def chat(base_url: str, model: str) -> httpx.Response:
    return httpx.post(base_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


def timed_chat(base_url: str, model: str) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    return chat(base_url, model), time.monotonic() - start


def test_a_template_that_never_ends_stalls_no_other_request_and_not_shutdown(
        evil_and_real: tuple[GatewayProc, WorkerProc], tiny_model_dir: Path) -> None:
    gw, _ = evil_and_real
    with ThreadPoolExecutor(8) as pool:
        start = time.monotonic()
        evil = [pool.submit(timed_chat, gw.base_url, "evil") for _ in range(7)]
        time.sleep(0.1)  # (before: the evil renders held the tokenizing threads now)
        live = []
        for _ in range(10):
            t = time.monotonic()
            assert httpx.get(gw.base_url + "/health/live", timeout=10).status_code == 200
            live.append(time.monotonic() - t)
        real = chat(gw.base_url, tiny_model_dir.name)
        assert real.status_code == 200, real.text
        answers = [f.result(timeout=60) for f in evil]
        took = time.monotonic() - start
    for resp, _ in answers:
        assert resp.status_code == 400, resp.text
        assert "took over" in resp.json()["error"]["message"]
    # The template was tried when the model joined and ran out of time on one short message:
    # its chats are refused without rendering (before, each burned a thread and the GIL for
    # its whole timeout, slowing every other request). Timed inside the gateway: the clients'
    # own start-up (TLS contexts, threads) is no part of it.
    refused = [e["total_ms"] for e in gw.log_lines()
               if e.get("event") == "request_end" and e.get("status") == 400]
    assert len(refused) == 7 and max(refused) < 1000 * TEMPLATE_TIMEOUT_S / 2, refused
    assert took < 4 * TEMPLATE_TIMEOUT_S + 5, took
    assert max(live) < 0.5, live
    lag = [line for line in gw.metrics().splitlines()
           if line.startswith("kestrel_event_loop_lag_seconds_count")]
    assert lag and float(lag[0].split()[-1]) > 0  # the loop's lateness is measured
    start = time.monotonic()
    gw.signal(signal.SIGTERM)
    assert gw.popen is not None and gw.popen.wait(timeout=DRAIN_S + 5) == 0
    assert time.monotonic() - start < DRAIN_S + 5


# Issue 42: arithmetic a message can trigger (each one bytecode step, so no render timeout
# stops it) and, in the last branch, a constant jinja used to fold while compiling the Hello.
ARITHMETIC = ("{% set n = messages[0].content|length %}"
              "{% if messages[0].content.startswith('pow') %}{{ 10 ** (n * 833334) }}"
              "{% elif messages[0].content.startswith('mul') %}{{ 'x' * (n * 300000000) }}"
              "{% elif messages[0].content.startswith('hi') %}{{ messages[0].content }}"
              "{% else %}{{ 10 ** 12000000 }}{% endif %}")


def test_template_arithmetic_is_refused_at_once_and_stalls_nothing_else(
        tiny_model_dir: Path) -> None:
    """Before: the Hello of this template froze the gateway for 26 s while jinja folded
    `10 ** 12000000`; each `pow` chat held the GIL for ~1.2 s (under the render timeout) and
    each `mul` chat allocated gigabytes. Now the peer is welcomed at once, every such chat is a
    400 naming the sandbox's limit, and the real model and liveness are served meanwhile."""
    with GatewayProc() as gw, WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1"):
        gw.wait_ready()
        with evil_peer(gw, tiny_model_dir, ARITHMETIC, hello_timeout_s=20) as welcomed:
            assert welcomed < 5, welcomed
            contents = ["pow", "mul", "else"] * 3
            with ThreadPoolExecutor(len(contents)) as pool:
                evil = [pool.submit(httpx.post, gw.base_url + "/v1/chat/completions",
                                    timeout=60, json={"model": "evil", "max_tokens": 2,
                                                      "messages": [{"role": "user",
                                                                    "content": text}]})
                        for text in contents]
                live = []
                for _ in range(10):
                    t = time.monotonic()
                    assert httpx.get(gw.base_url + "/health/live", timeout=10).status_code == 200
                    live.append(time.monotonic() - t)
                real, took = timed_chat(gw.base_url, tiny_model_dir.name)
                answers = [f.result(timeout=60) for f in evil]
            # A conversation the template fits still renders and is sent (the peer never
            # answers: the request's own timeout ends it).
            fits = httpx.post(gw.base_url + "/v1/chat/completions", timeout=60, json={
                "model": "evil", "max_tokens": 2, "timeout": 1,
                "messages": [{"role": "user", "content": "hi"}]})
        assert real.status_code == 200, real.text
        for resp in answers:
            assert resp.status_code == 400, resp.text
            assert "sandbox's limit" in resp.json()["error"]["message"], resp.text
        refused = [e["total_ms"] for e in gw.log_lines()
                   if e.get("event") == "request_end" and e.get("status") == 400]
        assert len(refused) == len(contents) and max(refused) < 500, refused
        # (the first probe meets the nine chats' connections arriving, on two busy cores)
        assert sorted(live)[len(live) // 2] < 0.1 and max(live) < 1.0, live
        # (no token by its deadline: a 504, where a refused render is a 400)
        assert fits.status_code == 504 and fits.json()["error"]["code"] == "timeout", fits.text


def deep_schema(depth: int = 8, width: int = 3, leaf: str = "string") -> dict:
    """A shared tree of objects (~400 KB as JSON): a fraction of a second to compile."""
    if depth == 0:
        return {"type": "string", "description": leaf}
    sub = deep_schema(depth - 1, width, leaf)
    names = [f"p{i}" for i in range(width)]
    return {"type": "object", "properties": dict.fromkeys(names, sub), "required": names}


def test_a_client_flooding_huge_grammars_gets_429s_and_others_are_served(
        tiny_model_dir: Path) -> None:
    """Issue 23: 8 concurrent 737 KB schemas made an unrelated chat wait 10.6 s. Compiling
    grammars has its own thread and two places per client: the flood's extra requests (each
    schema a little different, so none is served from the grammar cache) are refused at once,
    another client is served meanwhile."""
    with GatewayProc("--api-keys", "flood,calm") as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1"):
        gw.wait_ready()
        def flood(i: int) -> httpx.Response:
            schema = deep_schema(leaf=f"variant {i}")
            return httpx.post(gw.base_url + "/v1/chat/completions", timeout=60,
                              headers={"Authorization": "Bearer flood"}, json={
                                  "model": tiny_model_dir.name, "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "json"}],
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "deep", "schema": schema}}})

        with ThreadPoolExecutor(8) as pool:
            floods = [pool.submit(flood, i) for i in range(8)]
            calm = httpx.post(gw.base_url + "/v1/chat/completions", timeout=60,
                              headers={"Authorization": "Bearer calm"}, json={
                                  "model": tiny_model_dir.name, "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "hi"}]})
            codes = [f.result(timeout=120) for f in floods]
        assert calm.status_code == 200, calm.text
        busy = [r for r in codes if r.status_code == 429]
        assert busy and all(r.json()["error"]["code"] == "server_busy" for r in busy)
        assert all("retry-after" in r.headers for r in busy)
        assert any(r.status_code == 200 for r in codes)  # the flood's own first one compiles


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_huge_hello_stalls_no_stream_and_drops_no_worker(tiny_model_dir: Path) -> None:
    """Issue 23: a Hello with a 14 MB tokenizer and template for a new model got a healthy
    worker dropped ("silent for 2.1 s") and cost the gateway ~118 s of CPU and 2.4 GB: the
    template was compiled whatever its size. Now a template over MAX_TEMPLATE_CHARS is not
    compiled (that model's chat is a 400), and a stall of the gateway's own loop is not counted
    as a worker's silence. Meanwhile a stream from the real worker keeps its pace."""
    with GatewayProc() as gw, WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1"):
        gw.wait_ready()
        assert gw.popen is not None
        rss_before = rss_mb(gw.popen.pid)
        info = tiny_hello(tiny_model_dir).tokenizer
        template = "{% if messages %}{{ messages[0].content }}{% endif %}\n" * 220_000
        big = tiny_hello(tiny_model_dir, model_id="big",
                         tokenizer=dataclasses.replace(info, chat_template=template))
        assert 12e6 < len(codec.encode(big)[1]) < codec.MAX_FRAME_BYTES
        gaps: list[float] = []

        def stream() -> None:
            with httpx.stream("POST", gw.base_url + "/v1/completions", timeout=60, json={
                    "model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 200,
                    "ignore_eos": True, "stream": True}) as resp:
                last = time.monotonic()
                for _ in resp.iter_lines():
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(stream)
            time.sleep(0.5)
            peer = FakeWorker(gw.engine_address)
            try:
                start = time.monotonic()
                welcome = peer.hello(big, timeout_s=30)
                assert welcome is not None and welcome.accepted, welcome
                assert time.monotonic() - start < 10
                streaming.result(timeout=60)
                resp = chat(gw.base_url, "big")
            finally:
                peer.close()
        assert resp.status_code == 400, resp.text
        assert "over the gateway's limit" in resp.json()["error"]["message"]
        assert max(gaps) < 1.0, max(gaps)
        assert "silent for" not in gw.output(), gw.output()[-2000:]
        assert chat(gw.base_url, tiny_model_dir.name).status_code == 200
        assert rss_mb(gw.popen.pid) - rss_before < 400


def test_a_clients_third_large_body_is_refused_before_it_is_read(tiny_model_dir: Path) -> None:
    """Issue 23: one client sending 600 KB schemas in a loop held the gateway's loop with JSON
    parsing (in calls that hold the GIL) and made others wait seconds. A client has two
    requests with bodies over 64 KB in intake at once; a third is refused from its headers."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200000\r\n\r\n{")
    big = b'{"prompt": "hi", "max_tokens": 2}' + b" " * 100_000  # valid JSON, 100 KB
    with GatewayProc() as gw, WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1"):
        gw.wait_ready()
        holders = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(2)]
        try:
            for s in holders:
                s.sendall(head)  # their bodies are still on the way
            time.sleep(0.5)
            with socket.create_connection(("127.0.0.1", gw.port)) as third:
                third.sendall(head)
                third.settimeout(5)
                got = read_response(third)
            assert got.startswith(b"HTTP/1.1 429"), got[:300]
            assert b"bodies over 64 KB" in got and b"server_busy" in got
            other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
            with other:  # another client is served meanwhile, large body and all
                resp = other.post(gw.base_url + "/v1/completions", content=big, timeout=30,
                                  headers={"Content-Type": "application/json"})
            assert resp.status_code == 200, resp.text
        finally:
            for s in holders:
                s.close()
        for _ in range(50):  # the holders' shares come back when their connections go
            resp = httpx.post(gw.base_url + "/v1/completions", content=big, timeout=30,
                              headers={"Content-Type": "application/json"})
            if resp.status_code != 429:
                break
            time.sleep(0.1)
        assert resp.status_code == 200, resp.text


def test_a_large_grammar_is_built_without_stalling_running_streams(tiny_model_dir: Path) -> None:
    """Issue 23 (found by bench_isolation): the worker built a request's llguidance matcher on
    its engine loop, ~0.5 s for a 540 KB grammar, and every running sequence waited that long,
    for each such request. Now it is built on a thread of its own, and the stream keeps its pace.
    """
    with GatewayProc() as gw, WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1"):
        gw.wait_ready()
        gaps: list[float] = []

        def stream() -> None:
            with httpx.stream("POST", gw.base_url + "/v1/completions", timeout=60, json={
                    "model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 400,
                    "ignore_eos": True, "stream": True}) as resp:
                last = None
                for line in resp.iter_lines():
                    now = time.monotonic()
                    if last is not None and line.startswith("data: {"):
                        gaps.append(now - last)
                    last = now

        def constrained(i: int) -> httpx.Response:
            return httpx.post(gw.base_url + "/v1/chat/completions", timeout=60, json={
                "model": tiny_model_dir.name, "max_tokens": 4,
                "messages": [{"role": "user", "content": "json"}],
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "deep", "schema": deep_schema(leaf=f"variant {i}")}}})

        # A worker's first grammar also builds llguidance's tokenizer, once, holding the GIL
        # (engine_worker/grammar.py: ~0.2 s for this vocabulary): not what this test is about.
        assert httpx.post(gw.base_url + "/v1/chat/completions", timeout=60, json={
            "model": tiny_model_dir.name, "max_tokens": 2, "response_format": {
                "type": "json_object"}, "messages": [{"role": "user", "content": "{"}]},
        ).status_code == 200
        with ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(stream)
            time.sleep(0.3)
            for i in range(2):
                assert constrained(i).status_code == 200
            streaming.result(timeout=60)
        # Built on the loop, each of the two grammars held every stream for its build: two gaps
        # of a build's length. A loaded host may stall one token once, for its own reasons (CI
        # once saw a single 0.27 s gap among 351): one long gap is the host's, two the build's.
        long_gaps = [g for g in gaps if g > 0.25]
        assert len(gaps) > 100 and len(long_gaps) <= 1 and max(gaps) < 0.6, (
            len(gaps), sorted(gaps)[-5:])
