"""Routing and scaling with simulated-compute workers (no torch, one process per worker).

    python benchmarks/bench_routing.py [--seconds 12] [--workers 1,2,4,8]
                                       [--only scaling|shapes|prefix]

Three experiments, each against a real gateway and real `kestrel-sim-worker` processes over real
ZeroMQ; only the workers' compute is simulated (a sleep per engine step by a cost model):

  scaling   closed loop, concurrency = workers x max_num_seqs, short prompts: completion
            tokens/s with N workers against N x one worker's (goal: >= 0.9)
  shapes    the same ratio under three load shapes, streamed, 16 sequences and 60 ms a step
            per worker: bursts (2 x 16 x N streams at once, again when all have ended),
            Poisson and gamma (burstiness 0.5) arrivals at 1.25x what N workers can serve
            (429s are left out: the tokens/s counts what was served)
  prefix    16 long shared system prompts (one per "tenant") with unique questions, 4 workers
            whose prefix caches each hold only a few of them: prefix-hit rate (cached prompt
            tokens / prompt tokens, from the responses' usage) with routing cache_aware vs
            least_loaded

Prints Markdown tables. No assertion: figures go to INFERENCE_BENCHMARK_REPORT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.procs import GatewayProc, Proc  # noqa: E402


@dataclass
class Result:
    requests: int = 0
    errors: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0


def tokenizer_dir() -> Path:
    from engine_worker.model.loader import resolve_checkpoint

    cache = Path.home() / ".cache" / "kestrel"
    tiny = cache / "tiny-llama-seed0"
    return tiny if (tiny / "tokenizer.json").is_file() else resolve_checkpoint("default", cache)


def start(n: int, routing: str, worker_flags: list[str], gateway_flags: tuple[str, ...] = (),
          gateways: int = 1) -> tuple[GatewayProc, list[Proc]]:
    """A gateway (`gateways` API server processes) and n simulated workers that joined it."""
    count = ("--api-server-count", str(gateways)) if gateways > 1 else ()
    gw = GatewayProc("--routing", routing, "--max-queue", "1024", "--max-prompt-chars", "20000",
                     "--log-level", "WARNING", *count, *gateway_flags).start()
    links = gw.engine_address
    if gateways > 1:  # imported here: the benchmarks also run against builds without it
        from gateway.api_servers import link_address

        links = ",".join(link_address(gw.engine_address, i) for i in range(gateways))
    workers = [Proc([sys.executable, "-m", "engine_worker.simulated", "--model",
                     str(tokenizer_dir()), "--gateway-address", links,
                     "--log-level", "WARNING", *worker_flags]).start() for _ in range(n)]
    deadline = time.monotonic() + 90
    while True:
        try:  # each new connection may land on any of the processes: all must see n, and
            # every process must have answered (one still starting gets no connection yet)
            bodies = [httpx.get(gw.base_url + "/health", timeout=2).json()
                      for _ in range(4 * gateways)]
            seen = {b.get("api_server", {}).get("index", 0) for b in bodies}
            if all(len(b["workers"]) == n for b in bodies) and seen == set(range(gateways)):
                break
        except httpx.HTTPError:
            pass
        gone = [w for w in workers if w.popen is not None and w.popen.poll() is not None]
        if gone:  # a worker that died at start never joins: say so now, with its own output
            why = (f"a simulated worker exited with {gone[0].popen.poll()} before joining:\n"
                   f"{gone[0].output()[-2000:]}")
            stop(gw, workers)
            raise RuntimeError(why)
        if time.monotonic() > deadline:
            why = gw.output()[-2000:]
            stop(gw, workers)
            raise TimeoutError(why)
        time.sleep(0.1)
    return gw, workers


def stop(gw: GatewayProc, workers: list[Proc]) -> None:
    for w in workers:
        w.stop()
    gw.stop()


async def closed_loop(base_url: str, concurrency: int, seconds: float, prompts: list[str],
                      max_tokens: int, seed: int = 0) -> Result:
    res = Result()
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as http:
        t0 = time.monotonic()
        end = t0 + seconds

        async def user() -> None:
            while time.monotonic() < end:
                body = {"prompt": rng.choice(prompts) + f" q{rng.random():.6f}",
                        "max_tokens": max_tokens, "ignore_eos": True}
                r = await http.post("/v1/completions", json=body)
                res.requests += 1
                if r.status_code != 200:
                    res.errors += 1
                    continue
                usage = r.json()["usage"]
                res.completion_tokens += usage["completion_tokens"]
                res.prompt_tokens += usage["prompt_tokens"]
                res.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]

        await asyncio.gather(*(user() for _ in range(concurrency)))
        res.seconds = time.monotonic() - t0
    return res


def scaling(counts: list[int], seconds: float) -> None:
    seqs = 8
    flags = ["--max-num-seqs", str(seqs), "--step-base-ms", "120", "--decode-seq-ms", "1",
             "--prefill-token-ms", "0.05"]
    print("\n### Scaling: simulated workers, closed loop, concurrency = 8 x workers\n")
    print("| workers | requests | errors | completion tok/s | vs N x one worker |")
    print("|---:|---:|---:|---:|---:|")
    base = None
    for n in counts:
        gw, workers = start(n, "cache_aware", flags)
        try:
            asyncio.run(closed_loop(gw.base_url, n * seqs, 2.0, ["warm up"], 8))
            res = asyncio.run(closed_loop(gw.base_url, n * seqs, seconds,
                                          [f"short prompt {i}" for i in range(64)], 8))
        finally:
            stop(gw, workers)
        tps = res.completion_tokens / res.seconds
        base = base or tps / n
        print(f"| {n} | {res.requests} | {res.errors} | {tps:.1f} | {tps / (n * base):.2f} |",
              flush=True)


SHAPE_SEQS, SHAPE_STEP_S, SHAPE_TOKENS = 16, 0.06, 32


async def _streamed(port: int, prompt: str) -> int:
    """One streamed completion over a connection of its own, raw asyncio (httpx's per-request
    cost on these shared cores spread a burst's arrivals over most of a second); its completion
    tokens (0 for a 429 or an error)."""
    body = json.dumps({"prompt": prompt, "max_tokens": SHAPE_TOKENS, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        answer = await reader.read(-1)
    finally:
        writer.close()
    if not answer.startswith(b"HTTP/1.1 200"):
        return 0
    used = re.findall(rb'"completion_tokens":(\d+)', answer)
    return int(used[-1]) if used else 0


async def load_shape(base_url: str, n: int, shape: str, seconds: float, seed: int) -> float:
    """Completion tokens/s served: bursts, whole rounds over their time; open loop, streams
    that ended inside the window over the window."""
    rng = random.Random(seed)
    served = [0]
    port = int(base_url.rsplit(":", 1)[1])
    t0 = time.monotonic()
    end = t0 + seconds

    async def one() -> None:
        tokens = await _streamed(port, f"shape {rng.random():.9f}")
        if shape == "burst" or time.monotonic() <= end:
            served[0] += tokens

    if shape == "burst":  # whole rounds: the one that crosses the end is waited for
        while time.monotonic() < end:
            await asyncio.gather(*(one() for _ in range(2 * SHAPE_SEQS * n)))
        return served[0] / (time.monotonic() - t0)
    per_worker = SHAPE_SEQS / (SHAPE_TOKENS * SHAPE_STEP_S)  # requests/s one worker serves
    rate, k = 1.25 * n * per_worker, (1.0 if shape == "poisson" else 0.5)
    tasks = []
    while time.monotonic() < end:  # open loop: gamma gaps (shape 1: Poisson), mean 1 / rate
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(rng.gammavariate(k, 1.0 / (rate * k)))
    await asyncio.gather(*tasks)
    return served[0] / (end - t0)


def shapes(counts: list[int], seconds: float) -> None:
    flags = ["--max-num-seqs", str(SHAPE_SEQS), "--step-base-ms", str(SHAPE_STEP_S * 1000),
             "--decode-seq-ms", "0", "--prefill-token-ms", "0"]
    print(f"\n### Scaling under load shapes: simulated workers ({SHAPE_SEQS} sequences, "
          f"{SHAPE_STEP_S * 1000:.0f} ms a step), streamed, max_tokens {SHAPE_TOKENS}\n")
    names = ("burst", "poisson", "gamma")
    print("| workers | " + " | ".join(f"{s} tok/s | {s} vs N x one" for s in names) + " |")
    print("|---:|" + "---:|---:|" * len(names))
    base: dict[str, float] = {}
    for n in counts:
        gw, workers = start(n, "cache_aware", flags)
        cells = []
        try:
            asyncio.run(load_shape(gw.base_url, n, "burst", 2.0, 99))  # warm up
            for i, shape in enumerate(names):
                tps = asyncio.run(load_shape(gw.base_url, n, shape, seconds, i))
                base.setdefault(shape, tps / n)
                cells.append(f"{tps:.0f} | {tps / (n * base[shape]):.2f}")
        finally:
            stop(gw, workers)
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)


def prefix(seconds: float) -> None:
    n, tenants = 4, 16
    # Each worker's cache holds 4096 tokens: about 4 of the ~900-token system prompts.
    flags = ["--max-num-seqs", "8", "--kv-capacity-tokens", "4096", "--step-base-ms", "30",
             "--decode-seq-ms", "1", "--prefill-token-ms", "0.2"]
    prompts = [" ".join(f"tenant{t} rule {i} says be helpful." for i in range(110))
               for t in range(tenants)]
    print("\n### Shared prefixes: 16 system prompts, 4 simulated workers, concurrency 16\n")
    print("| routing | requests | errors | prefix-hit rate | completion tok/s |")
    print("|---|---:|---:|---:|---:|")
    for routing in ("cache_aware", "least_loaded"):
        gw, workers = start(n, routing, flags)
        try:
            res = asyncio.run(closed_loop(gw.base_url, 16, seconds, prompts, 8, seed=1))
        finally:
            stop(gw, workers)
        hit = res.cached_tokens / max(1, res.prompt_tokens)
        print(f"| {routing} | {res.requests} | {res.errors} | {hit:.3f} | "
              f"{res.completion_tokens / res.seconds:.1f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--only", choices=("scaling", "shapes", "prefix"), default=None)
    args = parser.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    if args.only in (None, "scaling"):
        scaling(counts, args.seconds)
    if args.only in (None, "shapes"):
        shapes(counts, args.seconds)
    if args.only in (None, "prefix"):
        prefix(args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
