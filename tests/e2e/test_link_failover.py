"""Failover between two real workers joining from separate source addresses (127.0.0.2 and
127.0.0.3, ZeroMQ's "tcp://SOURCE:0;GATEWAY" syntax): kill -9 one under load; only its streams
that had tokens fail, the ones still waiting at it are retried on the other and complete; it
rejoins and takes work again. And at scale, with simulated workers: 64 streams, a kill -9 fails
only the streams its worker was running.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.procs import GatewayProc, Proc, WorkerProc

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


def sim_worker(gw: GatewayProc, *flags: str) -> Proc:
    from benchmarks.bench_routing import tokenizer_dir

    return Proc([sys.executable, "-m", "engine_worker.simulated", "--model", str(tokenizer_dir()),
                 "--gateway-address", gw.engine_address, *flags]).start()


def test_kill_9_under_64_streams_fails_only_the_streams_the_lost_worker_was_running() -> None:
    """Two simulated workers of 16 sequences each, 64 streams at once (32 running, 32 queued at
    the gateway): a kill -9 fails at most the 16 its worker ran, each of which had tokens; every
    other stream completes, on the survivor."""
    seqs, streams, tokens = 16, 64, 48
    with GatewayProc("--default-timeout-s", "300", "--max-queue", "256") as gw:
        gw.wait_live()
        flags = ("--max-num-seqs", str(seqs), "--step-base-ms", "40", "--decode-seq-ms", "0")
        victim, survivor = sim_worker(gw, *flags), sim_worker(gw, *flags)
        try:
            wait_for(lambda: len(health(gw)["workers"]) == 2, 60, "two workers")
            victim_id = health(gw)["workers"][0]["id"]
            results: list[dict] = [{"tokens": 0, "error": None, "usage": None}
                                   for _ in range(streams)]

            async def one(http: httpx.AsyncClient, res: dict) -> None:
                body = {"prompt": "under load", "max_tokens": tokens, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            res["error"] = event["error"].get("code")
                        elif event.get("usage"):
                            res["usage"] = event["usage"]["completion_tokens"]
                        elif event["choices"]:
                            res["tokens"] += 1

            async def run() -> tuple[int, set[int]]:
                async with httpx.AsyncClient(base_url=gw.base_url, timeout=120) as http:
                    tasks = [asyncio.create_task(one(http, r)) for r in results]
                    # Both workers full, with tokens on their streams; then kill the first.
                    await asyncio.to_thread(wait_for, lambda: sum(
                        r["tokens"] >= 5 for r in results) >= 2 * seqs, 60, "tokens")
                    running = next(w for w in health(gw)["workers"] if w["id"] == victim_id)
                    had_tokens = {i for i, r in enumerate(results) if r["tokens"] > 0}
                    victim.kill()
                    await asyncio.gather(*tasks)
                return running["in_flight"], had_tokens

            in_flight, had_tokens = asyncio.run(run())
            failed = {i for i, r in enumerate(results) if r["error"] is not None}
            assert failed, "the kill failed no stream: it happened too late to test anything"
            assert len(failed) <= min(seqs, in_flight), (len(failed), in_flight)
            assert failed <= had_tokens
            assert {results[i]["error"] for i in failed} == {"worker_lost"}
            assert all(r["usage"] == tokens for i, r in enumerate(results) if i not in failed), \
                [r for r in results if r["error"] is None and r["usage"] != tokens]
        finally:
            victim.kill()
            survivor.stop()
