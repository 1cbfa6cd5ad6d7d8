"""Issue 36 end to end: steps sized by time, deadlines only when asked, admission that holds.

Real gateways and workers on loopback, real ZeroMQ, the official openai client where a client
is the point:
- a request's own timeout is honoured beyond the server's default (tiny model, long answer);
- with no deadline, requests beyond the seats wait in the queue and all finish (SmolLM2);
- a chat without max_tokens runs to its stop;
- a long prompt arriving while a stream decodes is prefilled in chunks sized by the step's
  measured time (the worker's step histogram), never in max_num_batched_tokens rows;
- a burst with deadlines: the 429s come at once and no admitted request ends by its deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import openai
import pytest

from tests.procs import GatewayProc, WorkerProc, decode_step_s

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smollm(smollm2_dir: Path) -> Iterator[GatewayProc]:
    """Four seats, the gateway's defaults (no deadline unless asked); steps sized by the share
    alone (--step-floor-ms 0: SmolLM2's 512-row chunk lasts about the default floor of 1 s on a
    2-core host, so with the floor the chunks would not tell the policies apart)."""
    with GatewayProc() as gw, WorkerProc(smollm2_dir, gw.engine_address, "--model-id", MODEL,
                                         "--max-num-seqs", "4", "--kv-cache-memory",
                                         "256MiB", "--step-floor-ms", "0") as wk:
        gw.wait_ready(timeout=180)
        yield gw
        assert wk.popen is not None and wk.popen.poll() is None
    assert "Traceback" not in gw.output()


def test_a_requests_own_timeout_is_honoured_beyond_the_servers_default(
        tiny_model_dir: Path) -> None:
    """Before, a request's timeout was cut to the server's default: min(timeout, default)."""
    with GatewayProc("--default-timeout-s", "0.5", "--max-tokens-cap", "2000") as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1") as _wk:
        gw.wait_ready()
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="x", max_retries=0)
        body = {"model": "tiny-llama-seed0", "prompt": "hi", "max_tokens": 1500,
                "extra_body": {"ignore_eos": True}}
        started = time.monotonic()
        done = client.completions.create(**{**body, "extra_body": {"ignore_eos": True,
                                                                    "timeout": 120}})
        took = time.monotonic() - started
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 1500
        # The same request without its own timeout has the server's 0.5 s: refused at once (400)
        # where the worker's measured costs say it cannot fit, else cut at its deadline (504).
        if took > 0.5:
            with pytest.raises(openai.APIStatusError) as exc:
                client.completions.create(**body)
            assert exc.value.status_code in (400, 504)


def test_without_a_deadline_requests_beyond_the_seats_wait_and_all_finish(
        smollm: GatewayProc) -> None:
    """Eight at once for four seats, no timeout anywhere: none is refused on an estimate."""
    async def one(session: aiohttp.ClientSession) -> tuple[int, dict]:
        async with session.post(smollm.base_url + "/v1/completions", json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 40,
                "ignore_eos": True}) as resp:
            return resp.status, await resp.json()

    async def run() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session) for _ in range(8)))

    results = asyncio.run(run())
    assert [status for status, _ in results] == [200] * 8, results
    assert all(body["usage"]["completion_tokens"] == 40 for _, body in results)


def test_a_chat_without_max_tokens_runs_to_its_stop(smollm: GatewayProc) -> None:
    """No max_tokens: the answer runs past a completion route's default of 16 tokens to the
    model's own end. A question with an answer of some lines, so it ends in seconds (a long
    module to write took 28 s of the suite)."""
    client = openai.OpenAI(base_url=smollm.base_url + "/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, temperature=0, messages=[
        {"role": "user", "content": "Name the twelve months of the year, one per line, each "
                                    "with a short note on its name."}])
    choice = chat.choices[0]
    assert choice.finish_reason == "stop", chat.usage
    assert chat.usage.completion_tokens > 16, chat.usage  # not a completion route's default


def _prefill_buckets(metrics: str) -> dict[float, float]:
    """kestrel_worker_step_prefill_tokens: cumulative count of steps by their prompt rows."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith("kestrel_worker_step_prefill_tokens_bucket{"):
            le = line.split('le="')[1].split('"')[0]
            out[float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_long_prompt_beside_a_decoding_stream_is_prefilled_in_time_sized_chunks(
        smollm: GatewayProc) -> None:
    """Before, the prompt went in max_num_batched_tokens (512) rows a step and the decoding
    stream waited for each such step. Now every step that carried prompt rows while the stream
    decoded stayed within 4x a decode step (the share): on any host, far fewer than 256 rows of
    SmolLM2."""
    client = openai.OpenAI(base_url=smollm.base_url + "/v1", api_key="x", max_retries=0)
    before = _prefill_buckets(httpx.get(smollm.base_url + "/metrics").text)
    stream = client.completions.create(model=MODEL, prompt="Count:", max_tokens=1000,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # it decodes now, and goes on decoding until we close it
    long_prompt = " ".join(f"item {i}," for i in range(200))  # ~1,200 tokens
    done = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert done.usage.prompt_tokens > 1000
    assert next(chunks).choices[0].finish_reason is None  # the stream still decodes
    stream.close()  # its cancel ends it at the worker
    after = _prefill_buckets(httpx.get(smollm.base_url + "/metrics").text)
    steps = {le: after[le] - before.get(le, 0.0) for le in after}
    over_256 = steps[float("inf")] - steps[256.0]
    with_prompt = steps[float("inf")] - steps[0.0]
    assert over_256 == 0, steps  # no 512-row step
    assert with_prompt >= done.usage.prompt_tokens / 256  # the prompt went in many chunks


def test_a_burst_with_deadlines_gets_its_429s_at_once_and_no_admitted_request_times_out(
        smollm: GatewayProc) -> None:
    """60 streams at once, each asking 10 s for as many tokens as two seconds of one-row decode
    steps make on this worker (its measured cost), on four seats: what cannot finish is refused
    before it runs; what is admitted finishes all its tokens."""
    tokens = max(8, int(2.0 / decode_step_s(smollm)))

    async def one(session: aiohttp.ClientSession) -> tuple[int, float, str | None]:
        start = time.monotonic()
        async with session.post(smollm.base_url + "/v1/completions", json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": tokens,
                "ignore_eos": True, "stream": True, "timeout": 10}) as resp:
            head = time.monotonic() - start
            finish = None
            async for line in resp.content:
                compact = line.replace(b" ", b"")
                if resp.status != 200:
                    finish = line.decode()  # the error, for the assertion's message
                elif compact.startswith(b"data:{") and b'"finish_reason":"' in compact:
                    finish = compact.split(b'"finish_reason":"')[1].split(b'"')[0].decode()
            return resp.status, head, finish

    async def run() -> list[tuple[int, float, str | None]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(one(session) for _ in range(60)))

    results = asyncio.run(run())
    admitted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(admitted) + len(refused) == 60, results
    assert admitted and refused, results
    assert all(finish == "length" for _, _, finish in admitted), admitted  # none by deadline
    assert max(head for _, head, _ in refused) < 5.0  # at once, not at the deadline
