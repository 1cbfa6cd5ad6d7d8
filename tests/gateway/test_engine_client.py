"""The link's request bookkeeping without sockets: retry once on a lost worker when nothing came
back yet, fail otherwise; worker-supplied finish reasons bounded before they become labels."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.engine_client import EngineClient, WorkerLost
from protocol import codec
from protocol import messages as m

TOK = m.TokenizerInfo('{"model": {}}', None, None, None, [0])


def client_with_workers(n: int) -> tuple[EngineClient, list[Any], list]:
    client = EngineClient("inproc://unused")
    sent: list = []

    async def fake_send(identity: bytes, msg: Any) -> bool:
        sent.append((identity, msg))
        return True

    client.link.send = fake_send  # type: ignore[method-assign]
    digest = codec.tokenizer_digest(TOK)
    workers = [client.registry.admit(f"w{i}".encode(), m.Hello(
        m.PROTOCOL_VERSION, f"w{i}", "tiny", 256, 4096, 8, TOK), digest,
        tokenizer=object() if i == 0 else None) for i in range(n)]  # type: ignore[arg-type]
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
