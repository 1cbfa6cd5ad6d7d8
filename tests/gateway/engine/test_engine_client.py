"""The link's request bookkeeping without sockets: retry once on a lost worker when nothing came
back yet, fail otherwise; worker-supplied finish reasons bounded before they become labels."""

from __future__ import annotations

import asyncio
import struct
import time
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.engine.engine_client import (
    FAULT_WINDOW_S,
    MAX_WORKER_FAULTS,
    EngineClient,
    NoWorkerError,
    WorkerLost,
)
from protocol import codec
from protocol import messages as m
from tests.gateway.fake_engine import LoopbackLink

TOK = m.TokenizerInfo('{"model": {}}', None, None, None, [0])
VOCAB = 100  # the fake tokenizer's


def client_with_workers(n: int, embedding_size: int = 0) -> tuple[EngineClient, list[Any], list]:
    sent: list = []

    async def fake_send(identity: bytes, msg: Any) -> bool:
        sent.append((identity, msg))
        return True

    client = EngineClient("inproc://unused", link=LoopbackLink(fake_send))
    digest = codec.tokenizer_digest(TOK)
    workers = [client.registry.admit(f"w{i}".encode(), m.Hello(
        m.PROTOCOL_VERSION, f"w{i}", "tiny", 256, 4096, 8, TOK, embedding_size=embedding_size),
        digest,
        tokenizer=SimpleNamespace(vocab_size=VOCAB) if i == 0 else None)  # type: ignore[arg-type]
        for i in range(n)]
    return client, workers, sent


def gen(rid: str = "r1") -> m.Generate:
    return m.Generate(rid, [1, 2, 3], m.SamplingParams(max_tokens=4))


def test_a_request_with_no_answer_yet_moves_once_to_another_worker() -> None:
    async def run() -> None:
        client, workers, sent = client_with_workers(3)
        handle = await client.submit("tiny", gen(), deadline=None)
        first = handle.worker
        client._drop_worker(first, "test")
        await asyncio.sleep(0)  # the retry's send task
        second = handle.worker
        assert second is not first and handle.events.empty()
        assert [type(msg) for _, msg in sent] == [m.Generate, m.Generate]
        assert sent[1][0] == second.identity
        client._drop_worker(second, "test")  # a second loss: no second retry
        assert isinstance(handle.events.get_nowait(), WorkerLost)
        client.link.close()

    asyncio.run(run())


def test_a_request_that_had_an_answer_fails_with_its_worker() -> None:
    async def run() -> None:
        client, workers, _ = client_with_workers(2)
        handle = await client.submit("tiny", gen(), deadline=None)
        await client._dispatch(handle.worker, m.TokenOutput("r1", 0, [5]))
        assert isinstance(handle.events.get_nowait(), m.TokenOutput)
        client._drop_worker(handle.worker, "test")
        assert isinstance(handle.events.get_nowait(), WorkerLost)
        client.link.close()

    asyncio.run(run())


def test_each_send_carries_the_time_left_not_a_wall_clock_deadline() -> None:
    async def run() -> None:
        client, _, sent = client_with_workers(1)
        await client.submit("tiny", gen(), deadline=time.monotonic() + 30)
        msg = sent[0][1]
        assert msg.deadline is None and 29 < msg.timeout_s <= 30
        client.link.close()

    asyncio.run(run())


def test_a_workers_load_counts_the_sequences_of_our_requests_on_it() -> None:
    async def run() -> None:
        client, _, _ = client_with_workers(1)
        await client.submit("tiny", gen("r1"), deadline=None)
        four = m.Generate("r2", [1], m.SamplingParams(max_tokens=4, n=3))
        second = await client.submit("tiny", four, deadline=None)
        assert client.load("tiny") == [("w0", 4)]  # 1 + 3 choices
        client.release(second)
        await client.submit("tiny", gen("r3"), deadline=None)
        assert client.load("tiny") == [("w0", 2)]
        client.link.close()

    asyncio.run(run())


def test_a_worker_invented_finish_reason_is_bounded_before_it_becomes_a_label() -> None:
    async def run() -> None:
        client, _, _ = client_with_workers(1)
        handle = await client.submit("tiny", gen(), deadline=None)
        await client._dispatch(handle.worker, m.TokenOutput("r1", 0, [5], "x" * 5000))
        assert handle.events.get_nowait().finish_reason == "abort"
        client.link.close()

    asyncio.run(run())


def test_a_peer_refused_again_and_again_is_logged_once_without_a_traceback(caplog: Any) -> None:
    async def run() -> None:
        client, _, sent = client_with_workers(0)
        bad = m.Hello(m.PROTOCOL_VERSION, "w-bad", "tiny", 256, 4096, 8,
                      m.TokenizerInfo("not json at all", None, None, None, [0]))
        for _ in range(50):
            await client.membership.on_hello(b"peer", [*codec.encode(bad)])
        assert len(sent) == 50 and all(not msg.accepted for _, msg in sent)

    with caplog.at_level("DEBUG", logger="kestrel"):
        asyncio.run(run())
    refusals = [r for r in caplog.records if "refused worker" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelname == "WARNING"
    assert "tokenizer did not load" in refusals[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)  # no traceback, at any level


# ---- issue 42: a worker is trusted with its model's output, never with the gateway -------------

BAD_FRAMES = {
    "tokens past max_tokens": m.TokenOutput("r1", 0, [5] * 5),
    "a token id outside the vocabulary": m.TokenOutput("r1", 0, [VOCAB]),
    "a negative token id": m.TokenOutput("r1", 0, [-1]),
    "a choice the request does not have": m.TokenOutput("r1", 1, [5]),
    "a frame with no token and no finish": m.TokenOutput("r1", 0, []),
    "logprobs that do not match the tokens": m.TokenOutput("r1", 0, [5], logprobs=[]),
    "a NaN logprob": m.TokenOutput("r1", 0, [5], logprobs=[(5, float("nan"), [])]),
    "an infinite top logprob": m.TokenOutput("r1", 0, [5],
                                             logprobs=[(5, -1.0, [(6, float("-inf"))])]),
    "an embedding for a request that asked for tokens": m.TokenOutput("r1", 0, [], "stop",
                                                                      embedding=bytes(8)),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_a_bad_frame_ends_its_request_with_a_502_error_and_cancels_it(name: str) -> None:
    async def run() -> None:
        client, _, sent = client_with_workers(1)
        handle = await client.submit("tiny", gen(), deadline=None)  # max_tokens=4, n=1
        await client._dispatch(handle.worker, BAD_FRAMES[name])
        await asyncio.sleep(0)  # the Cancel's send task
        error = handle.events.get_nowait()
        assert isinstance(error, m.RequestError) and error.code == "bad_worker_frame"
        assert handle.events.empty() and handle.closed and "r1" not in client.requests
        assert isinstance(sent[-1][1], m.Cancel) and sent[-1][1].request_id == "r1"
        await client._dispatch(handle.worker, m.TokenOutput("r1", 0, [5]))
        assert handle.events.empty()  # nothing more reaches a refused request
        client.link.close()

    asyncio.run(run())


def test_a_request_takes_max_tokens_and_one_last_frame_per_choice_and_no_more() -> None:
    async def run() -> None:
        client, _, _ = client_with_workers(1)
        handle = await client.submit("tiny", gen(), deadline=None)  # max_tokens=4
        for frame in (m.TokenOutput("r1", 0, [1, 2]), m.TokenOutput("r1", 0, [3]),
                      m.TokenOutput("r1", 0, [4], "length")):
            await client._dispatch(handle.worker, frame)
        taken = [handle.events.get_nowait() for _ in range(3)]
        assert [t.token_ids for t in taken] == [[1, 2], [3], [4]]
        await client._dispatch(handle.worker, m.TokenOutput("r1", 0, [], "stop"))
        assert isinstance(handle.events.get_nowait(), m.RequestError)  # after its last frame
        client.link.close()

    asyncio.run(run())


def test_a_worker_that_keeps_sending_bad_frames_is_dropped() -> None:
    async def run() -> None:
        client, [worker], _ = client_with_workers(1)
        for i in range(MAX_WORKER_FAULTS - 1):
            await client.submit("tiny", gen(f"r{i}"), deadline=None)
            await client._dispatch(worker, m.TokenOutput(f"r{i}", 0, [VOCAB + 7]))
            assert worker.identity in client.workers
        innocent = await client.submit("tiny", gen("innocent"), deadline=None)
        await client._dispatch(worker, m.StepOutputs([]))  # no honest step has no outputs
        assert worker.identity not in client.workers
        assert isinstance(innocent.events.get_nowait(), WorkerLost)
        client.link.close()

    asyncio.run(run())


def test_bad_frames_older_than_the_window_do_not_count_towards_a_drop() -> None:
    async def run() -> None:
        client, [worker], _ = client_with_workers(1)
        worker.faults = [time.monotonic() - FAULT_WINDOW_S - 1] * (MAX_WORKER_FAULTS + 5)
        await client._dispatch(worker, m.StepOutputs([]))
        assert worker.identity in client.workers and len(worker.faults) == 1
        client.link.close()

    asyncio.run(run())


@pytest.mark.parametrize("rows", [0, 5, 15, 16, 300, 70_000])
def test_step_rows_reads_the_row_count_without_decoding(rows: int) -> None:
    frames = codec.encode(m.StepOutputs([m.TokenOutput("r", 0, [1])] * rows))
    assert codec.step_rows(frames) == rows == len(codec.decode(frames).outputs)


def test_a_step_with_more_rows_than_could_have_run_is_refused_before_decoding(
        monkeypatch: Any) -> None:
    async def run() -> None:
        client, [worker], _ = client_with_workers(1)  # max_num_seqs 8
        handle = await client.submit("tiny", gen(), deadline=None)  # 1 sequence in flight
        decoded: list[Any] = []
        real_decode = codec.decode
        monkeypatch.setattr(codec, "decode", lambda body: decoded.append(1) or real_decode(body))
        ok = codec.encode(m.StepOutputs([m.TokenOutput("r1", 0, [5])]
                                        + [m.TokenOutput(f"gone-{i}", 0, [5]) for i in range(8)]))
        await client._on_frames(worker.identity, ok)  # 9 rows: 1 ours + 8 cancelled, at most
        assert decoded == [1] and handle.events.get_nowait().token_ids == [5]
        big = codec.encode(m.StepOutputs([m.TokenOutput(f"x{i}", 0, [5]) for i in range(10)]))
        await client._on_frames(worker.identity, big)
        assert decoded == [1] and len(worker.faults) == 1  # refused unread, counted
        client.link.close()

    asyncio.run(run())


def test_a_dropped_workers_hellos_are_refused_unread_for_a_while() -> None:
    async def run() -> None:
        client, [worker], sent = client_with_workers(1)
        for _ in range(MAX_WORKER_FAULTS):
            await client._dispatch(worker, m.StepOutputs([]))
        assert worker.identity not in client.workers
        client.membership.start_hello(worker.identity, codec.encode(worker.hello))
        await asyncio.gather(*client.membership.hellos.values())
        answer = sent[-1][1]
        assert isinstance(answer, m.Welcome) and not answer.accepted
        assert "dropped" in answer.reason and worker.identity not in client.workers
        client.link.close()

    asyncio.run(run())


def embed_gen() -> m.Generate:
    return m.Generate("e1", [1, 2, 3], m.SamplingParams(max_tokens=1, n=2), embed=True,
                      input_lengths=[1, 2])


VECTOR = struct.pack("<2f", 0.6, 0.8)
BAD_VECTORS = {
    "a vector of another size": m.TokenOutput("e1", 0, [], "stop", embedding=bytes(12)),
    "a NaN in the vector": m.TokenOutput("e1", 0, [], "stop",
                                         embedding=struct.pack("<2f", 1.0, float("nan"))),
    "tokens for an embedding request": m.TokenOutput("e1", 0, [5], "stop", embedding=VECTOR),
}


@pytest.mark.parametrize("name", list(BAD_VECTORS))
def test_an_embedding_request_takes_one_vector_of_its_worker_s_size_per_input(name: str) -> None:
    async def run() -> None:
        client, _, _ = client_with_workers(1, embedding_size=2)
        handle = await client.submit("tiny", embed_gen(), deadline=None)
        await client._dispatch(handle.worker, m.TokenOutput("e1", 1, [], "stop", 2,
                                                            embedding=VECTOR))
        assert handle.events.get_nowait().embedding == VECTOR
        await client._dispatch(handle.worker, BAD_VECTORS[name])
        error = handle.events.get_nowait()
        assert isinstance(error, m.RequestError) and error.code == "bad_worker_frame"
        client.link.close()

    asyncio.run(run())


def test_an_embedding_request_goes_only_to_workers_that_embed_and_whose_context_fits_an_input(
) -> None:
    async def run() -> None:
        client, _, _ = client_with_workers(1)  # a worker that computes no embeddings
        with pytest.raises(NoWorkerError):
            await client.submit("tiny", embed_gen(), deadline=None)
        client.link.close()
        client, _, sent = client_with_workers(1, embedding_size=2)
        long = m.Generate("e2", [1] * 400, m.SamplingParams(max_tokens=1, n=2), embed=True,
                          input_lengths=[200, 200])  # 400 tokens in all, each within 256
        await client.submit("tiny", long, deadline=None)
        assert sent[-1][1].request_id == "e2"
        client.link.close()

    asyncio.run(run())
