"""A guard on the gateway's cost per streamed token (issue 57), end to end: a real gateway, a
simulated worker whose steps cost nothing over real ZeroMQ, 64 streams in a closed loop
(benchmarks/bench_gateway_ceiling.py's client), the gateway process's CPU-seconds over a window.

No absolute time: the bound is a ratio to a baseline measured in the same test on the same host,
the CPU this process spends to frame one stream chunk (`sse_event`), the least a token can cost
the gateway. With the receive loop's turns (several frames, then the loop) a stream takes the
tokens queued for it in one wake-up, and a token cost ~7 chunk framings on a loaded 2-core
Xeon; with a yield after every frame (1f78c0e's loop) each stream woke once per token, and a
token cost 12-18. The bound sits between, generous for a loaded CI host.
"""

from __future__ import annotations

import time

from benchmarks import bench_gateway_ceiling
from gateway.http.streaming import sse_event

BOUND = 11.0  # gateway CPU per streamed token, in chunk framings


def chunk_cost(n: int = 20_000) -> float:
    """CPU-seconds of this thread to frame one completions chunk (the median of 5 runs)."""
    chunk = {"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1765000000,
             "model": "SmolLM2-135M-Instruct",
             "choices": [{"index": 0, "text": " token", "logprobs": None,
                          "finish_reason": None}]}
    runs = []
    for _ in range(5):
        t = time.thread_time()
        for _ in range(n):
            sse_event(chunk)
        runs.append((time.thread_time() - t) / n)
    return sorted(runs)[2]


def test_gateway_cpu_per_streamed_token_is_within_a_bound_of_a_chunks_framing() -> None:
    r = bench_gateway_ceiling.run(1, seqs=32, tokens=256, seconds=4.0, gateways=1)
    assert r["errors"] == 0 and r["tokens_s"] > 0, r
    per_token = r["cpu"] / r["tokens_s"]
    ratio = per_token / chunk_cost()
    assert ratio < BOUND, (f"the gateway spent {1e6 * per_token:.1f} us of CPU per streamed "
                           f"token, {ratio:.1f} chunk framings (bound {BOUND}): {r}")
