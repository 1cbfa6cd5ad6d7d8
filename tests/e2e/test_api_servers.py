"""Several gateway processes on one port (--api-server-count 2), end to end: real processes, real
ZeroMQ, a simulated worker joined to both engine links. Every process serves (the kernel spreads
new connections over them), the rate limit is one limit across them, a worker's capacity is split
between them, and SIGTERM to process 0 stops them all (kill -9 of process 0 too)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks import bench_routing
from gateway.api_servers import link_address
from tests.e2e.test_link_failover import sources_connected, wait_for
from tests.procs import GatewayProc, Proc

if sys.platform != "linux":
    pytest.skip("SO_REUSEPORT spreading and PR_SET_PDEATHSIG are Linux's", allow_module_level=True)


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def health_by_process(gw: GatewayProc, count: int = 2, timeout: float = 30) -> dict[int, dict]:
    """/health from fresh connections, by the index of the process that answered, until `count`
    processes have answered or `timeout` passes (the second process may still be starting when
    the first is ready)."""
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < deadline:
        body = httpx.get(gw.base_url + "/health", timeout=5).json()
        seen[body["api_server"]["index"]] = body
    return seen


def start(*flags: str) -> tuple[GatewayProc, Proc]:
    """Two gateway processes and a simulated worker of 8 sequences that joined both."""
    gw, workers = bench_routing.start(1, "cache_aware", ["--max-num-seqs", "8",
                                                         "--step-base-ms", "5"], flags, 2)
    return gw, workers[0]


def test_two_processes_share_the_port_and_the_worker_and_stop_together() -> None:
    gw, worker = start()
    try:
        assert gw.popen is not None
        kids = children(gw.popen.pid)
        assert len(kids) == 1
        seen = health_by_process(gw)
        assert sorted(seen) == [0, 1] and all(h["api_server"]["count"] == 2 for h in seen.values())
        # The worker joined both links, announcing half its 8 sequences on each.
        for i in range(2):
            port = int(link_address(gw.engine_address, i).rsplit(":", 1)[1])
            assert "127.0.0.1" in sources_connected(port)
        models = httpx.get(gw.base_url + "/v1/models", timeout=5).json()["data"]
        assert models

        async def burst() -> list[int]:
            async def one(i: int) -> int:
                async with httpx.AsyncClient(base_url=gw.base_url, timeout=60) as http:
                    r = await http.post("/v1/completions", json={
                        "prompt": f"spread {i}", "max_tokens": 8, "ignore_eos": True})
                    return r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
            # 8: what one process takes before any drain rate is measured (its 4 sequences,
            # and a queue as long), wherever the kernel puts them
            return await asyncio.gather(*(one(i) for i in range(8)))

        assert asyncio.run(burst()) == [8] * 8
    finally:
        worker.stop()
        assert gw.stop() == 0
    assert not any(os.path.exists(f"/proc/{pid}") for pid in kids)


def test_the_rate_limit_is_one_limit_across_the_processes() -> None:
    """A burst of 4 for this client: 16 fresh connections (landing on both processes) get 4
    answers between them, not 4 from each process."""
    gw, worker = start("--rate-limit-rps", "0.01", "--rate-limit-burst", "4")
    try:
        statuses = [httpx.post(gw.base_url + "/v1/completions", timeout=30, json={
            "prompt": "limited", "max_tokens": 1}).status_code for _ in range(16)]
        assert sorted(statuses) == [200] * 4 + [429] * 12
        # Process 0 killed outright: the other one does not go on serving alone.
        assert gw.popen is not None
        kids = children(gw.popen.pid)
        gw.kill()
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in kids), 30,
                 "the other process to exit with process 0")
    finally:
        worker.stop()
        gw.stop()


def test_a_killed_second_process_is_started_again_and_serves(tmp_path: Path) -> None:
    """kill -9 of process 1: process 0 logs it and starts it again on the same port and link,
    and the worker joins it again (its link's reconnect), so fresh connections reach both."""
    gw, worker = start()
    try:
        assert gw.popen is not None
        [kid] = children(gw.popen.pid)
        assert sorted(health_by_process(gw)) == [0, 1]
        os.kill(kid, signal.SIGKILL)
        wait_for(lambda: [k for k in children(gw.popen.pid) if k != kid], 30,
                 "process 0 to start process 1 again")
        assert "API server process 1 exited with status -9" in gw.output()
        # the worker's link to process 1 rejoins the new process (a Hello again, as after any
        # gateway restart)
        def process_1_ok() -> bool:
            try:
                return health_by_process(gw).get(1, {}).get("status") == "ok"
            except httpx.TransportError:  # a handshake caught as the port's socket group
                return False               # changes is reset (SO_REUSEPORT): ask again

        wait_for(process_1_ok, 60, "the worker to join the new process 1")
        statuses = [httpx.post(gw.base_url + "/v1/completions", timeout=30, json={
            "prompt": f"again {i}", "max_tokens": 2}).status_code for i in range(12)]
        assert statuses == [200] * 12
    finally:
        worker.stop()
        assert gw.stop() == 0
