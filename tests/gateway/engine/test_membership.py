"""Membership's liveness: a silent worker is lost, but a time the gateway itself could not listen
(its event loop held, e.g. by a thread holding the GIL while a huge Hello is built) is not the
worker's silence."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from gateway.engine.membership import Membership
from gateway.engine.registry import Registry, WorkerState
from protocol import codec
from tests.gateway.engine.test_registry import TOK, hello

FAKE_TOKENIZER = SimpleNamespace(vocab_size=100)  # what the registry reads of one

TIMEOUT_S = 0.3


def _membership() -> tuple[Membership, WorkerState, list[str]]:
    registry = Registry()
    worker = registry.admit(b"w", hello(), codec.tokenizer_digest(TOK),
                            tokenizer=FAKE_TOKENIZER)  # type: ignore[arg-type]
    lost: list[str] = []
    membership = Membership(link=None, registry=registry,  # type: ignore[arg-type]
                            heartbeat_timeout_s=TIMEOUT_S,
                            on_lost=lambda _w, reason: lost.append(reason))
    return membership, worker, lost


def test_a_worker_silent_past_the_timeout_is_lost() -> None:
    async def main() -> list[str]:
        membership, _worker, lost = _membership()
        loop = asyncio.create_task(membership.liveness_loop())
        await asyncio.sleep(TIMEOUT_S * 2)
        loop.cancel()
        return lost

    lost = asyncio.run(main())
    assert lost and lost[0].startswith("silent for"), lost


def test_a_beating_worker_survives_the_gateways_own_stall() -> None:
    async def main() -> list[str]:
        membership, worker, lost = _membership()
        stop = asyncio.Event()

        async def heartbeats() -> None:
            # The receive loop. After a stall it first reads the backlog of other frames that
            # arrived meanwhile, a frame per turn of the loop, before this worker's heartbeat.
            while not stop.is_set():
                woke = time.monotonic()
                worker.last_seen = woke
                await asyncio.sleep(TIMEOUT_S / 6)
                if time.monotonic() - woke > TIMEOUT_S:
                    for _ in range(100):
                        await asyncio.sleep(0)

        beats = asyncio.create_task(heartbeats())
        loop = asyncio.create_task(membership.liveness_loop())
        await asyncio.sleep(TIMEOUT_S)
        time.sleep(TIMEOUT_S * 4)  # the gateway's loop held: nothing is read or judged
        await asyncio.sleep(TIMEOUT_S)
        stop.set()
        loop.cancel()
        await beats
        return lost

    assert asyncio.run(main()) == []
