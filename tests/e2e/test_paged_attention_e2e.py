"""The in-place paged decode attention end to end (issue 10): a real gateway and worker on the
tiny random Llama with the kernel (the default) and a second pair with
KESTREL_PAGED_ATTENTION=gather give the same greedy completions to the same concurrent
requests (so decodes batch with ragged contexts), through the official openai client; each
worker's log says which path it took."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from engine_worker.kernel_build import compiler_missing
from tests.procs import GatewayProc, WorkerProc

PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):", "1, 2, 3, 4,",
           "A long time ago in a galaxy far, far away, there lived a", "Hello"]


@pytest.fixture(scope="module")
def gather_server(tiny_model_dir: Path) -> Iterator[tuple[GatewayProc, WorkerProc]]:
    with GatewayProc() as gw, WorkerProc(tiny_model_dir, gw.engine_address,
                                         env={"KESTREL_PAGED_ATTENTION": "gather"}) as wk:
        gw.wait_ready()
        yield gw, wk


def completions(gw: GatewayProc) -> list[str]:
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)

    def one(prompt: str) -> str:
        r = client.completions.create(model="tiny-llama-seed0", prompt=prompt, max_tokens=48,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 48
        return r.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: decodes share steps
        return list(pool.map(one, PROMPTS))


def test_kernel_and_gather_workers_give_the_same_greedy_text(
        tiny_server: tuple[GatewayProc, WorkerProc],
        gather_server: tuple[GatewayProc, WorkerProc]) -> None:
    if compiler_missing() is not None:
        pytest.skip(f"paged attention kernel not buildable here: {compiler_missing()}")
    got, ref = completions(tiny_server[0]), completions(gather_server[0])
    assert got == ref
    assert "reads the paged KV cache in place" in tiny_server[1].output()
    assert "gathers each context into a copy" in gather_server[1].output()
    assert "KESTREL_PAGED_ATTENTION=gather" in gather_server[1].output()
