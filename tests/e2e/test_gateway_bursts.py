"""A burst larger than the tokenizing pool's room, end to end (real gateway, two simulated workers
over real ZeroMQ, a raw asyncio client so that the 128 requests arrive within milliseconds):
once admission has measured a drain rate it has room for all of them (32 running, the rest
queued), and all of them are served.
Short plain prompts are tokenized on the loop; through the pool (2 threads, 64 waiting) about
half of such a burst was refused with 429 server_busy."""

from __future__ import annotations

import asyncio

from benchmarks import bench_routing
from benchmarks.bench_routing import SHAPE_TOKENS, _streamed


async def burst(port: int, size: int) -> list[int]:
    return await asyncio.gather(*(_streamed(port, f"burst {i}") for i in range(size)))


def test_a_burst_of_128_short_completions_is_served_whole() -> None:
    flags = ["--max-num-seqs", "16", "--step-base-ms", "10"]
    gw, workers = bench_routing.start(2, "cache_aware", flags,
                                      ("--max-queue", "256", "--default-timeout-s", "120"))
    try:
        # Cold, before any drain rate is measured, the queue takes one round of slots (32): a
        # first burst within that lets the gateway measure how fast the workers drain.
        assert asyncio.run(burst(gw.port, 64)) == [SHAPE_TOKENS] * 64
        assert asyncio.run(burst(gw.port, 128)) == [SHAPE_TOKENS] * 128
    finally:
        bench_routing.stop(gw, workers)
