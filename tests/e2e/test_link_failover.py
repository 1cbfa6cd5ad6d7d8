"""Failover between two real workers joining from separate source addresses (127.0.0.2 and
127.0.0.3, ZeroMQ's "tcp://SOURCE:0;GATEWAY" syntax): kill -9 one under load; only its streams
that had tokens fail, the ones still waiting at it are retried on the other and complete; it
rejoins and takes work again.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from tests.procs import GatewayProc, WorkerProc

STREAMS = 6


def engine_port(gw: GatewayProc) -> int:
    return int(gw.engine_address.rsplit(":", 1)[1])


def sources_connected(port: int) -> set[str]:
    """Local addresses of established TCP connections to `port` on this host."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if state == "01" and int(remote.split(":")[1], 16) == port:
            ip = bytes.fromhex(local.split(":")[0])[::-1]
            out.add(".".join(str(b) for b in ip))
    return out


def health(gw: GatewayProc) -> dict:
    return httpx.get(gw.base_url + "/health", timeout=5).json()


def wait_for(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Stream(threading.Thread):
    def __init__(self, gw: GatewayProc, i: int) -> None:
        super().__init__()
        self.gw, self.i = gw, i
        self.tokens = 0
        self.error: str | None = None
        self.done = False
        self.finish: str | None = None

    def run(self) -> None:
        body = {"prompt": f"stream {self.i} says", "max_tokens": 100, "ignore_eos": True,
                "stream": True, "temperature": 0}
        with httpx.stream("POST", self.gw.base_url + "/v1/completions", json=body,
                          timeout=120) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    self.error = event["error"].get("code") or "error"
                else:
                    self.tokens += 1  # one event per token frame (its text may be held back)
                    self.finish = event["choices"][0].get("finish_reason") or self.finish


def test_kill_one_worker_under_load_retries_its_waiting_streams(tiny_model_dir: Path) -> None:
    with GatewayProc("--max-outstanding", "32", "--default-timeout-s", "300") as gw:
        gw.wait_live()
        port = engine_port(gw)
        flags = ("--max-num-seqs", "2")
        a = WorkerProc(tiny_model_dir, f"tcp://127.0.0.2:0;127.0.0.1:{port}", *flags).start()
        b = None
        try:
            wait_for(lambda: len(health(gw)["workers"]) == 1, 120, "worker a")
            b = WorkerProc(tiny_model_dir, f"tcp://127.0.0.3:0;127.0.0.1:{port}", *flags).start()
            wait_for(lambda: len(health(gw)["workers"]) == 2, 120, "worker b")
            assert {"127.0.0.2", "127.0.0.3"} <= sources_connected(port)
            names = [w["id"] for w in health(gw)["workers"]]  # in joining order: a, b
            procs = {names[0]: (a, "127.0.0.2"), names[1]: (b, "127.0.0.3")}
            streams = [Stream(gw, i) for i in range(STREAMS)]
            for s in streams:
                s.start()
            # A worker with requests waiting behind its 2 running ones, and tokens on 4 streams:
            # both workers' running pairs have answered (a running request that has not answered
            # yet would rightly be retried, not failed).
            busy: list[str] = []

            def loaded() -> bool:
                busy[:] = [w["id"] for w in health(gw)["workers"] if w["in_flight"] > 2]
                return bool(busy) and sum(s.tokens > 0 for s in streams) >= 4

            wait_for(loaded, 60, "a worker with waiting requests")
            victim, (proc, source) = busy[0], procs[busy[0]]
            had_tokens = {s.i for s in streams if s.tokens > 0}
            proc.kill()
            for s in streams:
                s.join(120)
            failed = {s.i for s in streams if s.error is not None}
            assert failed, ([ln["msg"] for ln in gw.log_lines() if "dropped" in ln.get("msg", "")],
                            [(s.i, s.done, s.finish, s.tokens, s.error) for s in streams],
                            victim, had_tokens)
            assert all(s.error == "worker_lost" for s in streams if s.i in failed)
            assert failed <= had_tokens  # only streams that had tokens fail
            assert all(s.done and s.finish == "length" for s in streams if s.i not in failed), [
                (s.i, s.done, s.finish, s.tokens, s.error) for s in streams]
            moved = [ln for ln in gw.log_lines() if "sent elsewhere" in ln.get("msg", "")]
            assert moved and " 0 sent elsewhere" not in moved[-1]["msg"], moved
            # It rejoins from its own address and takes work again.
            again = WorkerProc(tiny_model_dir, f"tcp://{source}:0;127.0.0.1:{port}", *flags)
            if proc is a:
                a = again.start()
            else:
                b = again.start()
            wait_for(lambda: len(health(gw)["workers"]) == 2, 120, "the worker to rejoin")
            assert victim not in {w["id"] for w in health(gw)["workers"]}  # a new life
            assert source in sources_connected(port)
            for i in range(10):
                r = httpx.post(gw.base_url + "/v1/completions", timeout=30, json={
                    "prompt": f"after the rejoin {i}", "max_tokens": 3})
                assert r.status_code == 200
            assert any(e.get("event") == "request_start" for e in again.log_lines())
        finally:
            a.stop()
            if b is not None:
                b.stop()
