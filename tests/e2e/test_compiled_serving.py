"""`--compile decode` through the real gateway and worker (tiny model): concurrent greedy chats
give the same text as an eager worker's, the compile of each bucket is logged, and Inductor's
files land under the worker's --cache-dir."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from engine_worker.compiled_step import compiler_available  # noqa: F401 (the skip string)
from tests.procs import GatewayProc, WorkerProc

# A string: evaluated when a test of this module is set up, so Inductor (a second's import) is
# loaded only by the test process that runs them, not by every process that collects them.
pytestmark = pytest.mark.skipif("not compiler_available()",
                                reason="no C++ compiler: Inductor cannot build CPU kernels")

PROMPTS = ["Tell me a story about a fox.", "What is 2 + 2?"]


def _answers(gw: GatewayProc) -> list[str]:
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)

    def ask(prompt: str) -> str:
        r = client.chat.completions.create(
            model=client.models.list().data[0].id, temperature=0, max_tokens=24,
            messages=[{"role": "user", "content": prompt}])
        return r.choices[0].message.content or ""

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # decodes of several sequences per step
        return list(pool.map(ask, PROMPTS))


def test_compiled_worker_answers_like_the_eager_one(
        tiny_model_dir: Path, new_cache_dir: Callable[[], Path]) -> None:
    cache = new_cache_dir()  # Inductor's folder empty; our C++ kernels the host's (conftest.py)
    with GatewayProc() as gw, WorkerProc(tiny_model_dir, gw.engine_address) as _:
        gw.wait_ready()
        want = _answers(gw)
    # each bucket compiles on first use, on the engine loop: seconds to a minute per bucket on
    # a shared 2-core machine, longer than the gateway's default 30 s request deadline. Two
    # sequences at most: batch buckets 1 and 2 only (each bucket is one compile)
    with GatewayProc("--default-timeout-s", "300") as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address, "--compile", "decode",
                                         "--max-num-seqs", "2", "--cache-dir",
                                         str(cache)) as wk:
        gw.wait_ready()
        got = _answers(gw)
        log = wk.output()
    assert got == want
    assert "compiled decode graph" in log  # each bucket's one-time compile is reported
    assert any(p.is_file() for p in (cache / "inductor").rglob("*"))
