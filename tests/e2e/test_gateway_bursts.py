"""A burst larger than the tokenizing pool's room, end to end (real gateway, two simulated workers
over real ZeroMQ, a raw asyncio client so that the 128 requests arrive within milliseconds):
once admission has measured a drain rate it has room for all of them (32 running, the rest
queued), and all of them are served.
Short plain prompts are tokenized on the loop; through the pool (2 threads, 64 waiting) about
half of such a burst was refused with 429 server_busy."""

from __future__ import annotations

import asyncio
import sys

from benchmarks.bench_routing import SHAPE_TOKENS, _streamed, tokenizer_dir
from tests.e2e.test_link_failover import health, wait_for
from tests.procs import GatewayProc, Proc


def test_a_burst_of_128_short_completions_is_served_whole() -> None:
    with GatewayProc("--max-queue", "256", "--default-timeout-s", "120") as gw:
        gw.wait_live()
        workers = [Proc([sys.executable, "-m", "engine_worker.simulated", "--model",
                         str(tokenizer_dir()), "--gateway-address", gw.engine_address,
                         "--max-num-seqs", "16", "--step-base-ms", "10"]).start()
                   for _ in range(2)]
        try:
            wait_for(lambda: len(health(gw)["workers"]) == 2, 60, "two workers")

            async def burst(size: int) -> list[int]:
                return await asyncio.gather(*(_streamed(gw.port, f"burst {i}")
                                              for i in range(size)))

            # Cold, before any drain rate is measured, the queue takes one round of slots (32):
            # a first burst within that lets the gateway measure how fast the workers drain.
            assert asyncio.run(burst(64)) == [SHAPE_TOKENS] * 64
            assert asyncio.run(burst(128)) == [SHAPE_TOKENS] * 128
        finally:
            for w in workers:
                w.stop()
