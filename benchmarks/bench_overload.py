"""Overload benchmark (issue 17; not a timed test): a gateway and one worker on this host, then

    1. burst: `--burst` streaming completions (max_tokens `--max-tokens`) opened at once, no
       client-side connection limit: how fast each 429 arrives, what the admitted ones get;
    2. calibration: a closed loop at the worker's batch size for `--calib-s` seconds gives the
       sustainable rate (completions per second);
    3. Poisson: `--overload` x that rate for `--seconds` seconds, open loop.

Printed per phase: outcomes, 429 head latency p50/p99, admitted requests that ended in a timeout
(504), TTFT p50/p99/max of admitted requests against the deadline; then RSS of both processes
and the admission gauges. Run from the repository root:

    python benchmarks/bench_overload.py [--model DIR] [--burst 400] [--seconds 60]
                                        [--api-server-count 2] [--timeout-in-body]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.overload_client import (  # noqa: E402
    Outcome,
    Summary,
    gauges,
    ms,
    pct,
    rss_mib,
    stream,
)
from tests.procs import GatewayProc, WorkerProc  # noqa: E402

GAUGES = ("kestrel_requests_in_flight", "kestrel_requests_waiting",
          "kestrel_worker_kv_cache_usage_ratio", "kestrel_admission_", "kestrel_rejections_total")


def body(args: argparse.Namespace) -> dict:
    out = {"prompt": "Once upon a time", "max_tokens": args.max_tokens, "ignore_eos": True,
           "temperature": 0}
    if args.timeout_in_body:  # each request asks its own deadline; the server sets none
        out["timeout"] = args.deadline
    return out


async def burst(url: str, args: argparse.Namespace) -> Summary:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(
            total=args.deadline * 3)) as session:
        outs = await asyncio.gather(*(stream(session, url, body(args))
                                      for _ in range(args.burst)))
    return Summary(list(outs))


async def closed_loop(url: str, args: argparse.Namespace, concurrency: int) -> float:
    done = 0
    end = time.monotonic() + args.calib_s
    async with aiohttp.ClientSession() as session:
        async def loop() -> None:
            nonlocal done
            while time.monotonic() < end:
                out = await stream(session, url, body(args))
                done += out.result == "ok"
        start = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.monotonic() - start)


async def poisson(url: str, args: argparse.Namespace, rate: float) -> Summary:
    rng = random.Random(0)
    tasks: list[asyncio.Task[Outcome]] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(
            total=args.deadline * 3)) as session:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(stream(session, url, body(args))))
            await asyncio.sleep(rng.expovariate(rate))
        outs = await asyncio.gather(*tasks)
    return Summary(list(outs))


def report(title: str, summary: Summary, deadline: float, gw: GatewayProc | None = None,
           seen: int = 0) -> int:
    """Print a phase; with `gw`, also the 429s' time inside the gateway (arrival in the app to
    the answer, from its request_end log lines after the first `seen`). Returns the lines seen."""
    print(f"\n## {title}")
    for line in summary.lines(deadline):
        print("  " + line)
    if gw is None:
        return seen
    ends = [e for e in gw.log_lines() if e.get("event") == "request_end"]
    inside = [e["total_ms"] / 1000 for e in ends[seen:] if e.get("status") == 429]
    print(f"  429 inside the gateway (app arrival to answer): p50 {ms(pct(inside, 50))} ms, "
          f"p99 {ms(pct(inside, 99))} ms, max {ms(max(inside) if inside else None)} ms")
    return len(ends)


def wait_idle(base: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if httpx.get(base + "/health", timeout=5).json()["queue"]["outstanding"] == 0:
            return
        time.sleep(0.5)


def links(gw: GatewayProc, count: int) -> str:
    """The engine link address(es) a worker joins: one per gateway process."""
    if count == 1:
        return gw.engine_address
    from gateway.api_servers import link_address

    return ",".join(link_address(gw.engine_address, i) for i in range(count))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(Path.home() / ".cache/kestrel/tiny-llama-seed0"))
    p.add_argument("--burst", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--calib-s", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--overload", type=float, default=10.0)
    p.add_argument("--deadline", type=float, default=30.0, help="the gateway's default")
    p.add_argument("--timeout-in-body", action="store_true",
                   help="each request asks `timeout: --deadline` itself (no server default)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip", default="", help="comma list of phases to skip: burst,poisson")
    p.add_argument("--api-server-count", type=int, default=1, help="gateway processes")
    args = p.parse_args()
    count = ["--api-server-count", str(args.api_server_count)] if args.api_server_count > 1 else []
    deadline = [] if args.timeout_in_body else ["--default-timeout-s", str(args.deadline)]
    with GatewayProc(*deadline, *count) as gw, \
            WorkerProc(args.model, links(gw, args.api_server_count), "--threads", str(args.threads),
                       "--max-num-seqs", str(args.max_num_seqs),
                       env={"KESTREL_LOG_LEVEL": "WARNING"}) as wk:
        gw.wait_ready(timeout=300)
        while not all(httpx.get(gw.base_url + "/health", timeout=5).json()["workers"]
                      for _ in range(8 * args.api_server_count)):
            time.sleep(0.2)  # every gateway process has the worker
        assert gw.popen is not None and wk.popen is not None
        url = gw.base_url + "/v1/completions"
        rss0 = (rss_mib(gw.popen.pid), rss_mib(wk.popen.pid))
        asyncio.run(closed_loop(url, argparse.Namespace(**{**vars(args), "calib_s": 3.0}), 2))
        seen = 0
        if "burst" not in args.skip:
            t0 = time.monotonic()
            s = asyncio.run(burst(url, args))
            seen = report(f"burst: {args.burst} streams at once, max_tokens {args.max_tokens} "
                          f"({time.monotonic() - t0:.0f} s)", s, args.deadline, gw)
            wait_idle(gw.base_url)
        if "poisson" not in args.skip:
            rate = asyncio.run(closed_loop(url, args, args.max_num_seqs))
            print(f"\nsustainable rate (closed loop, concurrency {args.max_num_seqs}, "
                  f"{args.calib_s:.0f} s): {rate:.2f} completions/s")
            s = asyncio.run(poisson(url, args, rate * args.overload))
            report(f"Poisson at {args.overload:g}x = {rate * args.overload:.2f} req/s for "
                   f"{args.seconds:.0f} s", s, args.deadline, gw, seen)
            wait_idle(gw.base_url)
        rss1 = (rss_mib(gw.popen.pid), rss_mib(wk.popen.pid))
        print(f"\nRSS MiB gateway {rss0[0]:.0f} -> {rss1[0]:.0f}, worker {rss0[1]:.0f} -> "
              f"{rss1[1]:.0f}")
        for key, value in gauges(gw.metrics(), GAUGES).items():
            print(f"  {key} {value}")
        traces = gw.output().count("Traceback")
        print(f"tracebacks in the gateway log: {traces}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
