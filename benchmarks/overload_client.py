"""Client side of the overload benchmarks (bench_overload.py, bench_soak.py): one streaming
request, timed, and the figures a run reports.

    stream(session, url, body, behaviour) ──▶ Outcome: status, time to the response head (the
        429 latency), time to the first token (TTFT), how it ended (ok, 429 reason, timeout,
        an error event or status, dropped, stalled)

Behaviours: "normal" reads everything; "dropped" disconnects after the first token; "slow" reads
one event every `slow_s` seconds. A never-reading client is a raw socket (`never_reading`): it
sends its request and then reads nothing until the run ends.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Outcome:
    kind: str  # normal, dropped, slow, never_reading
    start: float
    status: int = 0
    head_s: float | None = None  # to the response head: what a 429 costs its client
    ttft_s: float | None = None
    end_s: float | None = None
    result: str = "pending"  # ok, queue_full, would_miss_deadline, timeout, error:<code>, ...
    retry_after: str | None = None


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 kind: str = "normal", slow_s: float = 2.0) -> Outcome:
    out = Outcome(kind, time.monotonic())
    try:
        async with session.post(url, json={**body, "stream": True}) as resp:
            out.status = resp.status
            out.head_s = time.monotonic() - out.start
            if resp.status != 200:
                data = await resp.read()
                try:
                    out.result = json.loads(data)["error"]["code"] or f"http_{resp.status}"
                except (ValueError, KeyError, TypeError):
                    out.result = f"http_{resp.status}"
                out.retry_after = resp.headers.get("retry-after")
                return out
            out.result = "ok"
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.result = "timeout" if event["error"].get("code") == "timeout" \
                        else f"error:{event['error'].get('code')}"
                    continue
                if any(c.get("finish_reason") == "timeout" for c in event.get("choices", [])):
                    out.result = "timeout"
                has_text = any(c.get("text") or (c.get("delta") or {}).get("content")
                               for c in event.get("choices", []))
                if has_text and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - out.start
                    if kind == "dropped":
                        out.result = "dropped"
                        return out  # leaving the context closes the connection
                if kind == "slow":
                    await asyncio.sleep(slow_s)
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
        out.result = f"client_error:{type(exc).__name__}"
    finally:
        out.end_s = time.monotonic() - out.start
    return out


async def never_reading(host: str, port: int, path: str, body: dict[str, Any],
                        stop: asyncio.Event) -> Outcome:
    """Send a streaming request, read nothing until `stop`, then close."""
    out = Outcome("never_reading", time.monotonic())
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        await asyncio.get_running_loop().sock_sendall(
            sock, b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        await stop.wait()
        out.result = "stalled"
    except OSError as exc:
        out.result = f"client_error:{type(exc).__name__}"
    finally:
        sock.close()
        out.end_s = time.monotonic() - out.start
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


@dataclass
class Summary:
    outcomes: list[Outcome] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        c: dict[str, int] = {}
        for o in self.outcomes:
            c[o.result] = c.get(o.result, 0) + 1
        return dict(sorted(c.items()))

    def rejected_head(self) -> list[float]:
        return [o.head_s for o in self.outcomes if o.status == 429 and o.head_s is not None]

    def admitted_ttft(self) -> list[float]:
        return [o.ttft_s for o in self.outcomes if o.status == 200 and o.ttft_s is not None]

    def lines(self, deadline_s: float) -> list[str]:
        rej, ttft = self.rejected_head(), self.admitted_ttft()
        admitted = [o for o in self.outcomes if o.status == 200]
        timeouts = [o for o in admitted if o.result == "timeout"]
        return [
            f"requests {len(self.outcomes)}: {self.counts()}",
            f"429: {len(rej)}, head latency p50 {ms(pct(rej, 50))} ms, p99 {ms(pct(rej, 99))} "
            f"ms, max {ms(max(rej) if rej else None)} ms",
            f"admitted: {len(admitted)}, ended in timeout (504): {len(timeouts)}; TTFT p50 "
            f"{ms(pct(ttft, 50))} ms, p99 {ms(pct(ttft, 99))} ms, max "
            f"{ms(max(ttft) if ttft else None)} ms (deadline {deadline_s:.0f} s)",
        ]


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def gauges(metrics_text: str, names: tuple[str, ...]) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in metrics_text.splitlines():
        if line.startswith(names):
            key, _, value = line.rpartition(" ")
            found[key] = value
    return found
