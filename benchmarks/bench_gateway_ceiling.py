"""The gateway's ceiling: how many streamed tokens/s one gateway delivers when the workers cost
nothing, so that only the gateway (and the client on the same cores) limits the rate.

    python benchmarks/bench_gateway_ceiling.py [--workers 1,2,4,8] [--seconds 10]
                                               [--seqs 64] [--tokens 256] [--gateways 1]

Each run starts a real gateway (`--api-server-count` G when --gateways G) and N
`kestrel-sim-worker` processes whose steps cost 0 ms (`--step-base-ms 0`, 64 sequences each), then
keeps 2 x 64 x N streams busy in a closed loop (each asks for 256 tokens with ignore_eos and
`stream_options.include_usage`). The client is raw asyncio over HTTP/1.1 keep-alive connections
that reads the chunked body and takes the completion tokens from the final usage chunk, so it
costs the shared cores as little as a client can. Reported per N:

  tokens/s   tokens the client received inside the window, over the window: streams that ended
             in it by their usage, the ones still running at its edges by the text they had
             (the simulated tokens are fixed, so a text's length says how many tokens it holds)
  gateway CPU  user + system seconds of the gateway process(es) over the window, per second
  loop lag   kestrel_event_loop_lag_seconds (a timer due every 100 ms) over the window: mean,
             and the share of samples later than 40 ms (a bucket bound)

Prints a Markdown table; no assertion: figures go to INFERENCE_BENCHMARK_REPORT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_routing  # noqa: E402
from benchmarks.bench_routing import tokenizer_dir  # noqa: E402
from tests.procs import GatewayProc, Proc  # noqa: E402

USAGE = re.compile(rb'"completion_tokens":(\d+)')
TICK = os.sysconf("SC_CLK_TCK")


class Ids:
    """The simulated worker's tokens are fixed (FIRST_TOKEN + i mod 64), so the text a stream
    received tells how many tokens it got: the longest prefix of ids whose decode fits."""

    def __init__(self, tokens: int) -> None:
        from tokenizers import Tokenizer

        from engine_worker.sim_engine import FIRST_TOKEN

        tok = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))
        ids = [FIRST_TOKEN + i % 64 for i in range(tokens)]
        self.lengths = [len(tok.decode(ids[:k])) for k in range(tokens + 1)]

    def count(self, body: bytes) -> int:
        chars = 0
        for event in body.split(b"\n\n"):
            if event.startswith(b"data: {"):
                choices = json.loads(event[6:]).get("choices") or []
                chars += sum(len(c.get("text") or "") for c in choices)
        return bisect.bisect_right(self.lengths, chars) - 1


@dataclass
class Window:
    """Tokens the client received between t0 and t1, over every stream."""

    tokens: int = 0
    streams: int = 0  # ended inside the window
    errors: int = 0
    open: bool = False  # between t0 and t1


class User:
    """One closed-loop client connection: a stream, then the next, until `end`."""

    def __init__(self, ids: Ids, out: Window) -> None:
        self.ids, self.out = ids, out
        self.body = bytearray()  # the stream in progress, so far
        self.base = 0  # its tokens at t0 (counted before the window)
        self.busy = False

    def snapshot(self, opening: bool) -> None:
        """At t0 (opening): what the stream in progress already has is not the window's. At t1:
        what it has by now is."""
        got = self.ids.count(bytes(self.body)) if self.busy else 0
        if opening:
            self.base = got
        else:
            self.out.tokens += got - self.base

    async def run(self, host: str, port: int, body: bytes, end: float) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                "Content-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        try:
            while time.monotonic() < end:
                writer.write(head + body)
                status = await reader.readline()
                chunked, length = False, 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    lower = line.lower()
                    chunked |= lower.startswith(b"transfer-encoding: chunked")
                    if lower.startswith(b"content-length:"):
                        length = int(lower.split(b":")[1])
                if not chunked:  # an error answer (429...): read it, count it, go on
                    await reader.readexactly(length)
                    self.out.errors += 1
                    await asyncio.sleep(0.05)
                    continue
                self.body.clear()
                self.busy = True
                while size := int((await reader.readline()).split(b";")[0], 16):
                    self.body += (await reader.readexactly(size + 2))[:-2]
                await reader.readline()
                self.busy = False
                found = USAGE.findall(self.body[-4096:])
                if b" 200 " not in status or not found or b'"error"' in self.body:
                    self.out.errors += 1
                elif self.out.open:
                    self.out.tokens += int(found[-1]) - self.base
                    self.out.streams += 1
                self.base = 0
        finally:
            writer.close()


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


def gateway_pids(gw: GatewayProc) -> list[int]:
    """The gateway process and its children (the other API server processes)."""
    assert gw.popen is not None
    pids = [gw.popen.pid]
    for task in Path(f"/proc/{gw.popen.pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def loop_lag(gw: GatewayProc) -> tuple[float, float, float]:
    """(sum, count, samples <= 40 ms) of the lag histogram of the process that answers (a
    gateway far behind may take many seconds to answer at all). 40 ms is a bucket bound of
    that histogram (gateway/telemetry/metrics.py LATENCY_BUCKETS); 50 ms was not, so every
    sample read as late."""
    try:
        text = httpx.get(gw.base_url + "/metrics", timeout=120).text
    except httpx.HTTPError:
        return math.nan, math.nan, math.nan
    total = count = under = 0.0
    for line in text.splitlines():
        if line.startswith("kestrel_event_loop_lag_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("kestrel_event_loop_lag_seconds_count"):
            count += float(line.split()[-1])
        elif line.startswith('kestrel_event_loop_lag_seconds_bucket{le="0.04"}'):
            under += float(line.split()[-1])
    return total, count, under


def start(n: int, seqs: int, gateways: int) -> tuple[GatewayProc, list[Proc]]:
    flags = ["--max-num-seqs", str(seqs), "--step-base-ms", "0", "--decode-seq-ms", "0",
             "--prefill-token-ms", "0"]
    return bench_routing.start(n, "cache_aware", flags, ("--max-queue", "4096"), gateways)


def run(n: int, seqs: int, tokens: int, seconds: float, gateways: int) -> dict[str, float]:
    gw, workers = start(n, seqs, gateways)
    try:
        body = json.dumps({"model": "", "prompt": "ceiling", "max_tokens": tokens,
                           "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        model = httpx.get(gw.base_url + "/v1/models", timeout=5).json()["data"][0]["id"]
        body = body.replace(b'"model": ""', f'"model": "{model}"'.encode())
        out, ids = Window(), Ids(tokens)
        pids = gateway_pids(gw)

        async def measure() -> tuple[float, float, tuple[float, float, float]]:
            users = [User(ids, out) for _ in range(2 * seqs * n)]
            t0 = time.monotonic() + 3.0  # warm up
            t1 = t0 + seconds
            tasks = [asyncio.create_task(u.run("127.0.0.1", gw.port, body, t1)) for u in users]
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))
            for u in users:
                u.snapshot(opening=True)
            out.open = True
            cpu0, lag0 = cpu_seconds(pids), loop_lag(gw)
            await asyncio.sleep(max(0.0, t1 - time.monotonic()))
            out.open = False
            for u in users:
                u.snapshot(opening=False)
            cpu1, lag1 = cpu_seconds(pids), loop_lag(gw)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return cpu0, cpu1, tuple(b - a for a, b in zip(lag0, lag1, strict=True))

        cpu0, cpu1, (lag_sum, lag_count, lag_under) = asyncio.run(measure())
    finally:
        for w in workers:
            w.stop()
        gw.stop()
    return {"tokens_s": out.tokens / seconds, "streams": out.streams, "errors": out.errors,
            "cpu": (cpu1 - cpu0) / seconds, "lag_ms": 1000 * lag_sum / max(1.0, lag_count),
            "late": 1 - lag_under / max(1.0, lag_count)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--gateways", type=int, default=1)
    args = parser.parse_args()
    print(f"\n### Gateway ceiling: zero-cost simulated workers, {args.seqs} sequences each, "
          f"2 x {args.seqs} x N streams of {args.tokens} tokens, {args.gateways} gateway "
          "process(es)\n")
    print("| workers | streams done | errors | streamed tokens/s | gateway CPU (s/s) | "
          "loop lag mean (ms) | lag > 40 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.workers.split(",")):
        r = run(n, args.seqs, args.tokens, args.seconds, args.gateways)
        print(f"| {n} | {r['streams']} | {r['errors']} | {r['tokens_s']:.0f} | {r['cpu']:.2f} | "
              f"{r['lag_ms']:.1f} | {100 * r['late']:.0f}% |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
