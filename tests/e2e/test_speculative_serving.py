"""Speculative decoding end to end: real gateway and workers on loopback, the tiny random Llama,
the official `openai` client. One worker speculates (n-gram lookup, k = 4), one does not; at
temperature 0 they must stream the same text, and cancel, n > 1, logprobs and stop strings keep
working with several tokens per frame. A third drafts with a model and ends each round at a
draft it doubts (--speculative-draft-confidence)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import GatewayProc, WorkerProc

K = 4
# Repeats give prompt lookup something to find; the tiny model tends to loop, which it finds too.
PROMPT = "the quick brown fox jumps over the lazy dog; " * 6


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path) -> Iterator[tuple[GatewayProc, WorkerProc, GatewayProc]]:
    # A long deadline: the cancel test asks for 1000 tokens, which a busy host may not finish
    # in the default 30 s (the gateway would refuse it at once as unreachable).
    with GatewayProc("--default-timeout-s", "300") as gw_spec, WorkerProc(
        tiny_model_dir, gw_spec.engine_address, "--speculative-method", "ngram",
        "--num-speculative-tokens", str(K), "--speculative-min-acceptance", "0",
    ) as wk_spec, GatewayProc() as gw_off, WorkerProc(tiny_model_dir, gw_off.engine_address):
        gw_spec.wait_ready()
        gw_off.wait_ready()
        yield gw_spec, wk_spec, gw_off


def client(gw: GatewayProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)


MODEL = "tiny-llama-seed0"


def stream_text(gw: GatewayProc, speculative: bool = True) -> tuple[str, int]:
    text, chunks = "", 0
    extra = {"ignore_eos": True, "speculative": speculative}
    for chunk in client(gw).completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                               temperature=0, max_tokens=60, extra_body=extra):
        text += chunk.choices[0].text if chunk.choices else ""
        chunks += 1
    return text, chunks


def counter(gw: GatewayProc, name: str) -> float:
    for line in httpx.get(gw.base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_speculative_streams_the_same_text_as_off(servers) -> None:  # noqa: ANN001
    gw_spec, _, gw_off = servers
    on, _ = stream_text(gw_spec)
    off, _ = stream_text(gw_off)
    assert on == off and on
    # The heartbeat carries the counters; give it a beat.
    deadline = time.monotonic() + 5
    while counter(gw_spec, "kestrel_spec_decode_accepted_tokens_total") == 0:
        assert time.monotonic() < deadline, "no accepted drafts reached the gateway's metrics"
        time.sleep(0.1)
    assert counter(gw_spec, "kestrel_spec_decode_verify_steps_total") > 0
    assert counter(gw_off, "kestrel_spec_decode_proposed_tokens_total") == 0


def settled(gw: GatewayProc, name: str, beats: int = 4, timeout: float = 10) -> float:
    """The counter once the worker's heartbeats (every 0.25 s) have brought the same value
    `beats` times running: the last steps of an earlier request reach the gateway a beat late
    (a clean-clone run read it mid-way, and saw an opted-out request 'propose' 20 tokens)."""
    deadline = time.monotonic() + timeout
    value, same = counter(gw, name), 0
    while same < beats:
        assert time.monotonic() < deadline, f"{name} never settled"
        time.sleep(0.25)
        now = counter(gw, name)
        value, same = now, (same + 1 if now == value else 0)
    return value


def test_opt_out_per_request(servers) -> None:  # noqa: ANN001
    gw_spec, _, gw_off = servers
    before = settled(gw_spec, "kestrel_spec_decode_proposed_tokens_total")
    on, _ = stream_text(gw_spec, speculative=False)
    assert on == stream_text(gw_off)[0]
    time.sleep(1.0)  # heartbeats: a proposal would have shown by now
    assert counter(gw_spec, "kestrel_spec_decode_proposed_tokens_total") == before


def test_n_logprobs_and_stop_strings(servers) -> None:  # noqa: ANN001
    gw_spec, _, gw_off = servers
    base, _ = stream_text(gw_off)
    stop = base[len(base) // 2 : len(base) // 2 + 6]  # a string the greedy text reaches
    results = []
    for gw in (gw_spec, gw_off):
        results.append(client(gw).completions.create(
            model=MODEL, prompt=PROMPT, temperature=0, max_tokens=60, n=2, logprobs=2,
            stop=[stop], extra_body={"ignore_eos": True}))
    on, off = results
    assert [c.text for c in on.choices] == [c.text for c in off.choices]
    for c in on.choices:
        assert stop not in c.text and c.finish_reason == "stop"
        assert base.startswith(c.text)
    for a, b in zip(on.choices, off.choices, strict=True):
        assert a.logprobs.tokens == b.logprobs.tokens
        assert a.logprobs.token_logprobs == pytest.approx(b.logprobs.token_logprobs, abs=1e-3)
        assert all(len(t) == 2 for t in a.logprobs.top_logprobs)
    assert on.usage.completion_tokens == off.usage.completion_tokens


def test_cancel_mid_stream_stops_within_one_step(servers) -> None:  # noqa: ANN001
    gw_spec, wk_spec, _ = servers
    body = (b'{"prompt": "%s", "max_tokens": 1000, "ignore_eos": true, "temperature": 0, '
            b'"stream": true}' % PROMPT.encode())
    before = len([e for e in wk_spec.request_ends().values() if "cancel_received_ts" in e])
    sock = socket.create_connection(("127.0.0.1", gw_spec.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    sock.settimeout(60)
    received = b""
    while received.count(b"data: ") < 5:
        chunk = sock.recv(4096)
        assert chunk, received.decode(errors="replace")[-2000:]  # closed before 5 events
        received += chunk
    sock.close()
    deadline = time.monotonic() + 10
    while True:
        ends = [e for e in wk_spec.request_ends().values() if "cancel_received_ts" in e]
        if len(ends) > before:
            break
        assert time.monotonic() < deadline, wk_spec.output()[-2000:]
        time.sleep(0.05)
    end = sorted(ends, key=lambda e: e["ts"])[-1]
    # One step emits at most the accepted drafts plus one token.
    assert end["tokens_after_cancel"] <= K + 1
    assert end["finish_reasons"] == ["abort"]


@pytest.fixture(scope="module")
def draft_gateway(tiny_model_dir: Path) -> Iterator[GatewayProc]:
    """A worker drafting with a model (the tiny Llama drafting for itself) whose rounds end
    where the next draft's odds fall below 0.99: the tiny random model is never that sure."""
    with GatewayProc("--default-timeout-s", "300") as gw, WorkerProc(
        tiny_model_dir, gw.engine_address, "--speculative-method", "draft",
        "--draft-model", str(tiny_model_dir), "--num-speculative-tokens", str(K),
        "--speculative-min-acceptance", "0", "--speculative-draft-confidence", "0.99",
    ):
        gw.wait_ready()
        yield gw


def test_a_doubted_draft_ends_its_round_and_the_text_is_unchanged(
        servers, draft_gateway: GatewayProc) -> None:  # noqa: ANN001
    """--speculative-draft-confidence end to end: one draft a verification (the draft model
    doubts each), and the same streamed text as the worker that does not speculate."""
    _, _, gw_off = servers
    on, _ = stream_text(draft_gateway)
    off, _ = stream_text(gw_off)
    assert on == off and on
    verified = settled(draft_gateway, "kestrel_spec_decode_verify_steps_total")
    assert verified > 0
    assert settled(draft_gateway, "kestrel_spec_decode_proposed_tokens_total") == verified


@pytest.mark.smollm
def test_a_gguf_draft_is_served_requantized_and_the_text_is_unchanged(
        servers, tiny_model_dir: Path) -> None:  # noqa: ANN001
    """--speculative-draft-quantization auto (the default) end to end: the embedded SmolLM2
    GGUF (Q4_1 layers, a Q8_0 head; the tiny Llama's tokenizer) drafts with every matrix
    re-quantized to Q4_0, the worker's start log says so, drafts are verified, and the streamed
    text is the worker's that does not speculate."""
    _, _, gw_off = servers
    with GatewayProc("--default-timeout-s", "300") as gw, WorkerProc(
        tiny_model_dir, gw.engine_address, "--speculative-method", "draft",
        "--draft-model", "default", "--num-speculative-tokens", str(K),
        "--speculative-min-acceptance", "0", "--speculative-draft-confidence", "0",
    ) as worker:
        gw.wait_ready()
        on, _ = stream_text(gw)
        assert on == stream_text(gw_off)[0] and on
        assert settled(gw, "kestrel_spec_decode_proposed_tokens_total") > 0
        said = [e.get("msg", "") for e in worker.log_lines()
                if e.get("logger") == "kestrel.speculative"]
    assert any("matmul plan: q4_0: int_dot" in s and "head q4_0" in s
               and "re-quantized to q4_0" in s for s in said), said
