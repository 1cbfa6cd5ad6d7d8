"""Issue 42, end to end: admission's seats and queue are each model's own.

The limit was the sum of every ready worker's max_num_seqs, whatever model it served: a worker
of another model announcing 1,024 sequences lifted the limit of a 2-sequence SmolLM2 worker, 12
requests went to it at once and 8 got 504. Here a real tiny worker runs 2 sequences, and a peer
joins as the worker of model "big" announcing 1,024: the tiny model's requests beyond its 2 seats
wait in the gateway's queue (where their deadlines and Retry-After are decided), not at its
worker.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from protocol import messages as m
from tests.e2e.link_peers import FakeWorker, tiny_hello
from tests.procs import GatewayProc, WorkerProc


def test_another_models_big_worker_lends_no_seats(tiny_model_dir: Path) -> None:
    with GatewayProc() as gw, WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1",
                                         "--max-num-seqs", "2"):
        gw.wait_ready()
        peer = FakeWorker(gw.engine_address)
        big = tiny_hello(tiny_model_dir, model_id="big", max_num_seqs=1024)
        assert peer.hello(big) is not None
        stop = threading.Event()

        def heartbeats() -> None:
            while not stop.wait(0.2):
                peer.send(m.Heartbeat(big.worker_id, m.Stats()))

        beat = threading.Thread(target=heartbeats, daemon=True)
        beat.start()
        seen: list[dict] = []
        try:
            def complete(_: int) -> httpx.Response:
                return httpx.post(gw.base_url + "/v1/completions", timeout=120, json={
                    "model": tiny_model_dir.name, "prompt": "Hello", "max_tokens": 48,
                    "temperature": 0, "ignore_eos": True})

            with ThreadPoolExecutor(12) as pool:
                answers = pool.map(complete, range(12))
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    queue = httpx.get(gw.base_url + "/health", timeout=10).json()["queue"]
                    seen.append(queue)
                    if queue["waiting"] == 0 and queue["outstanding"] == 0 and len(seen) > 5:
                        break
                    time.sleep(0.02)
                codes = [r.status_code for r in answers]
        finally:
            stop.set()
            beat.join()
            peer.close()
    assert codes == [200] * 12, codes
    assert max(q["outstanding"] for q in seen) <= 2, seen  # the tiny model's own two seats
    assert max(q["waiting"] for q in seen) >= 5, seen  # the rest waited at the gateway
