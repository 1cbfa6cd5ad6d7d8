"""A seeded request at temperature 0.8 gives the same text alone and among 8 other running
requests (issue 21): the default model as `make serve` serves it (the embedded GGUF, compute
paths measured on this host, decode rows through the C++ decode stack), real gateway and worker
processes, the openai client. `make test-avx2` runs this file again with torch, oneDNN and our
kernels capped to AVX2, so both ISAs' paths are shown on any host.

Before the decode stack, a decode row sharing its step with a prefill chunk of more rows than the
integer-dot kernel serves (16 on the Ice Lake) was computed by another kernel, and a seeded
sampled text could change with the batch around it."""

from __future__ import annotations

import threading
from pathlib import Path

import openai
import pytest

from tests.procs import GatewayProc, WorkerProc

pytestmark = pytest.mark.smollm

SEEDED = dict(messages=[{"role": "user", "content": "Write a short story about a lighthouse "
                                                   "keeper and a storm."}],
              max_tokens=40, temperature=0.8, seed=1234)
# the others: different prompts (each its own prefill), long enough to outlast the seeded one
OTHERS = [f"List {n} facts about the planet {p}." for n, p in
          zip(range(3, 11), ["Mars", "Venus", "Saturn", "Jupiter", "Mercury", "Neptune",
                             "Uranus", "Earth"], strict=True)]


def test_a_seeded_request_gives_the_same_text_alone_and_among_eight_others(
        cache_dir: Path) -> None:
    with GatewayProc("--default-timeout-s", "300") as gw, WorkerProc(
            "default", gw.engine_address, "--model-id", "smol",
            "--cache-dir", str(cache_dir)):
        gw.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)
        def seeded(**change: object) -> str:
            answer = client.chat.completions.create(model="smol", **{**SEEDED, **change})
            return answer.choices[0].message.content or ""  # type: ignore[no-any-return]

        # The first run puts the prompt's full blocks in the prefix cache; later runs compute
        # only the rest, fewer rows, which may take another kernel: so "alone" is a warm run, as
        # the run among the others is. (The cold run's text can differ: not a batch effect.)
        seeded()
        alone = seeded()

        started = [threading.Event() for _ in OTHERS]
        finished = [threading.Event() for _ in OTHERS]
        stop = threading.Event()

        def run(i: int) -> None:
            stream = client.completions.create(model="smol", prompt=OTHERS[i], max_tokens=400,
                                               temperature=0.7, seed=i, stream=True,
                                               extra_body={"ignore_eos": True})
            for _ in stream:
                started[i].set()
                if stop.is_set():
                    break
            stream.close()
            finished[i].set()

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        try:
            assert all(e.wait(120) for e in started), "the eight others did not all stream"
            among = seeded()
            busy = sum(not e.is_set() for e in finished)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert busy == 8, f"only {busy} of the 8 others were still running"
        assert len(alone) > 40 and among == alone
        assert seeded(seed=4321) != alone  # sampled, not a forced answer
