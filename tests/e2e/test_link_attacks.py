"""The engine-link attacks of issue 12, each against real processes on loopback (tiny model).

A peer the test plays with its own ZeroMQ socket: a Hello whose chat template takes seconds to
compile, a frame over the size limit, megabytes of token frames from a stranger, a Hello with
another tokenizer or inflated capacity under the real model's name.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import httpx
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol import codec
from protocol import messages as m
from tests.e2e.link_peers import FakeWorker, tiny_hello
from tests.procs import GatewayProc, WorkerProc

SLOW_TEMPLATE = "{% if messages %}x{% endif %}" * 10_000  # ~2 s to compile here, > 1.5 s timeout


def complete(gw: GatewayProc, **body: object) -> httpx.Response:
    return httpx.post(gw.base_url + "/v1/completions", json={
        "prompt": "Hello there", "max_tokens": 5, "temperature": 0, **body}, timeout=30)


def test_a_slow_tokenizer_hello_does_not_stall_heartbeats_or_requests(
        tiny_server: tuple[GatewayProc, WorkerProc], tiny_model_dir: Path) -> None:
    gw, _ = tiny_server
    real = [w["id"] for w in httpx.get(gw.base_url + "/health", timeout=5).json()["workers"]]
    assert real
    slow = tiny_hello(tiny_model_dir, model_id="slow-template")
    slow = dataclasses.replace(slow, tokenizer=dataclasses.replace(
        slow.tokenizer, chat_template=SLOW_TEMPLATE))
    slow = dataclasses.replace(slow, tokenizer_digest=codec.tokenizer_digest(slow.tokenizer))
    fake = FakeWorker(gw.engine_address)
    try:
        fake.send(slow)
        started = time.monotonic()
        while time.monotonic() - started < 4:  # while the template compiles in a thread
            assert complete(gw).status_code == 200
        welcome = fake.recv(30)
        assert isinstance(welcome, m.Welcome) and welcome.accepted
    finally:
        fake.close()
    # The fake itself sends no heartbeats once welcomed and may rightly be dropped for silence
    # (on a quiet machine its template compiles well inside the loop above); the real worker
    # must never be.
    for name in real:
        assert f"worker {name} dropped" not in gw.output()


def test_a_frame_over_the_size_limit_drops_the_connection_before_it_is_read(
        tiny_server: tuple[GatewayProc, WorkerProc]) -> None:
    gw, _ = tiny_server
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(gw.engine_address)
    try:
        assert monitor.poll(10_000)
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
        sock.send_multipart([b"\x01", b"\x00" * (codec.MAX_FRAME_BYTES + 1024)], zmq.NOBLOCK)
        assert monitor.poll(10_000), "the gateway kept a connection sending an oversized frame"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert complete(gw).status_code == 200
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


def test_decoding_stranger_frames_never_blocks_health_live(
        tiny_server: tuple[GatewayProc, WorkerProc]) -> None:
    gw, _ = tiny_server
    big = codec.encode(m.TokenOutput("r", 0, [1] * 3_000_000))  # ~3 MB of token ids
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                t0 = time.monotonic()
                assert http.get(gw.base_url + "/health/live").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.01)

    thread = threading.Thread(target=probe)
    thread.start()
    fake = FakeWorker(gw.engine_address)
    try:
        for _ in range(5):
            fake.sock.send_multipart(big)
            time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
        fake.close()
    assert len(latencies) > 20
    # The old gateway spent 3.9 s decoding one such frame on its event loop.
    assert max(latencies) < 0.1, sorted(latencies)[-5:]


def test_a_worker_with_another_tokenizer_or_inflated_capacity_is_refused(
        tiny_server: tuple[GatewayProc, WorkerProc], tiny_model_dir: Path) -> None:
    gw, _ = tiny_server
    other = tiny_hello(tiny_model_dir)
    other = dataclasses.replace(other, tokenizer=dataclasses.replace(
        other.tokenizer, chat_template="{{ 'injected' }}"))
    other = dataclasses.replace(other, tokenizer_digest=codec.tokenizer_digest(other.tokenizer))
    for hello, why in ((other, "tokenizer differs"),
                       (tiny_hello(tiny_model_dir, max_num_seqs=1_000_000), "max_num_seqs")):
        fake = FakeWorker(gw.engine_address)
        try:
            welcome = fake.hello(hello)
            assert welcome is not None and not welcome.accepted and why in welcome.reason
        finally:
            fake.close()
    health = httpx.get(gw.base_url + "/health").json()
    assert len(health["workers"]) == 1
    assert complete(gw).status_code == 200


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_a_gateway_restart_under_16_streams_brings_no_hello_storm(tiny_model_dir: Path) -> None:
    first = GatewayProc().start()
    worker = WorkerProc(tiny_model_dir, first.engine_address, "--max-num-seqs", "16").start()
    second = None
    try:
        first.wait_ready()
        assert complete(first).status_code == 200
        idle_gw, idle_wk = rss_mb(first.popen.pid), rss_mb(worker.popen.pid)
        streams: list[httpx.Response] = []
        client = httpx.Client(timeout=30)
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        for _ in range(16):
            req = client.build_request("POST", first.base_url + "/v1/completions", json=body)
            streams.append(client.send(req, stream=True))
        first.kill()  # kill -9 with 16 streams in flight
        for resp in streams:
            resp.close()
        client.close()
        second = GatewayProc("--port", str(first.port), "--engine-address",
                             first.engine_address)
        second.port, second.base_url = first.port, first.base_url
        second.engine_address = first.engine_address
        second.start()
        second.wait_ready()
        time.sleep(5)
        assert complete(second).status_code == 200
        joined = [ln for ln in second.log_lines() if "ready: model" in ln.get("msg", "")]
        resets = [ln for ln in worker.log_lines() if "new hello" in ln.get("msg", "")]
        assert len(joined) == 1 and len(resets) <= 1, (len(joined), len(resets))
        assert rss_mb(second.popen.pid) < 2 * idle_gw
        assert rss_mb(worker.popen.pid) < 2 * idle_wk
    finally:
        if second is not None:
            second.stop()
        worker.stop()
        first.stop()
