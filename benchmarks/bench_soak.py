"""Soak benchmark (issue 14; not a timed test): a gateway and one worker on this host, loaded at
`--overload` x the sustainable rate for `--seconds` with a mix of clients:

    normal (reads everything) | dropped (leaves after its first token) | never_reading (a raw
    socket that sends its request and reads nothing until the run ends) | slow (one event read
    every `--slow-s` seconds)

Printed: outcomes per kind, 429 head latency p50/p99, 5xx answers, RSS of both processes at
start and end, the in-flight / waiting / KV gauges once the run has drained (goal: back to
idle), and tracebacks in the gateway's log. Run from the repository root:

    python benchmarks/bench_soak.py [--model DIR] [--seconds 60] [--overload 10]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_overload import GAUGES, closed_loop, wait_idle  # noqa: E402
from benchmarks.overload_client import (  # noqa: E402
    Outcome,
    Summary,
    gauges,
    ms,
    never_reading,
    pct,
    rss_mib,
    stream,
)
from tests.procs import GatewayProc, WorkerProc  # noqa: E402

MIX = (("normal", 0.4), ("dropped", 0.2), ("never_reading", 0.2), ("slow", 0.2))


async def soak(gw: GatewayProc, args: argparse.Namespace, rate: float) -> Summary:
    rng = random.Random(0)
    body = {"prompt": "Once upon a time", "max_tokens": args.max_tokens, "ignore_eos": True}
    url = gw.base_url + "/v1/completions"
    stop = asyncio.Event()
    tasks: list[asyncio.Task[Outcome]] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(
            total=args.seconds + 120)) as session:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            kind = rng.choices([k for k, _ in MIX], [w for _, w in MIX])[0]
            if kind == "never_reading":
                coro = never_reading("127.0.0.1", gw.port, "/v1/completions", body, stop)
            else:
                coro = stream(session, url, body, kind, args.slow_s)
            tasks.append(asyncio.create_task(coro))
            await asyncio.sleep(rng.expovariate(rate))
        stop.set()  # the never-reading clients close now
        outs = await asyncio.gather(*tasks)
    return Summary(list(outs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(Path.home() / ".cache/kestrel/tiny-llama-seed0"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--calib-s", type=float, default=15.0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--overload", type=float, default=10.0)
    p.add_argument("--slow-s", type=float, default=2.0)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    with GatewayProc() as gw, \
            WorkerProc(args.model, gw.engine_address, "--threads", str(args.threads),
                       "--max-num-seqs", str(args.max_num_seqs),
                       env={"KESTREL_LOG_LEVEL": "WARNING"}) as wk:
        gw.wait_ready(timeout=300)
        assert gw.popen is not None and wk.popen is not None
        url = gw.base_url + "/v1/completions"
        calib = argparse.Namespace(max_tokens=args.max_tokens, calib_s=args.calib_s)
        rate = asyncio.run(closed_loop(url, calib, args.max_num_seqs))
        wait_idle(gw.base_url)
        rss0 = (rss_mib(gw.popen.pid), rss_mib(wk.popen.pid))
        print(f"sustainable rate (closed loop, concurrency {args.max_num_seqs}): {rate:.2f}/s; "
              f"soak at {args.overload:g}x = {rate * args.overload:.2f} req/s for "
              f"{args.seconds:.0f} s, mix {dict(MIX)}")
        t0 = time.monotonic()
        s = asyncio.run(soak(gw, args, rate * args.overload))
        print(f"load ended after {time.monotonic() - t0:.0f} s")
        for line in s.lines(30.0):
            print("  " + line)
        for kind, _ in MIX:
            mine = Summary([o for o in s.outcomes if o.kind == kind])
            print(f"  {kind}: {mine.counts()}")
        rej = s.rejected_head()
        print(f"  429 head latency p50 {ms(pct(rej, 50))} ms, p99 {ms(pct(rej, 99))} ms")
        print(f"  5xx answers: {sum(1 for o in s.outcomes if o.status >= 500)}")
        t1 = time.monotonic()
        wait_idle(gw.base_url, timeout=120)
        print(f"idle {time.monotonic() - t1:.1f} s after the load ended")
        rss1 = (rss_mib(gw.popen.pid), rss_mib(wk.popen.pid))
        print(f"RSS MiB gateway {rss0[0]:.0f} -> {rss1[0]:.0f}, worker {rss0[1]:.0f} -> "
              f"{rss1[1]:.0f}")
        for key, value in gauges(gw.metrics(), GAUGES).items():
            print(f"  {key} {value}")
        print(f"tracebacks in the gateway log: {gw.output().count('Traceback')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
