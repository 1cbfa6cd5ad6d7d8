"""Membership's liveness: a silent worker is lost, but a time the gateway itself could not listen
(its event loop held, e.g. by a thread holding the GIL while a huge Hello is built) is not the
worker's silence, nor is a silence the worker announced (Heartbeat.quiet_s), within a bound."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from gateway.engine.membership import Membership
from gateway.engine.registry import MAX_QUIET_S, Registry, WorkerState
from protocol import codec
from protocol import messages as m
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


def _silence(announce: float | None, wait_s: float) -> list[str]:
    """A worker that sends one heartbeat (saying it will be quiet for `announce` seconds, or
    nothing) and then nothing for `wait_s`: what the liveness loop said."""
    async def main() -> list[str]:
        membership, worker, lost = _membership()
        worker.last_seen = time.monotonic()
        worker.on_heartbeat(m.Heartbeat("w", m.Stats(), quiet_s=announce or 0.0))
        loop = asyncio.create_task(membership.liveness_loop())
        await asyncio.sleep(wait_s)
        loop.cancel()
        return lost

    return asyncio.run(main())


def test_a_silence_the_worker_announced_is_not_counted_and_one_past_it_is() -> None:
    assert _silence(None, TIMEOUT_S * 3)  # the same silence, unannounced: lost
    assert _silence(TIMEOUT_S * 4, TIMEOUT_S * 3) == []
    lost = _silence(TIMEOUT_S, TIMEOUT_S * 4)  # silent beyond what it announced, then the timeout
    assert lost and lost[0].startswith("silent for"), lost


def test_a_worker_beating_again_is_judged_from_its_beats() -> None:
    registry = Registry()
    worker = registry.admit(b"w", hello(), codec.tokenizer_digest(TOK),
                            tokenizer=FAKE_TOKENIZER)  # type: ignore[arg-type]
    worker.on_heartbeat(m.Heartbeat("w", m.Stats(), quiet_s=10.0))
    now = time.monotonic()
    assert worker.silent_for(now + 5) < 0
    worker.on_heartbeat(m.Heartbeat("w", m.Stats()))  # the GIL-holding work is done
    assert worker.silent_for(now + 5) == pytest.approx(now + 5 - worker.last_seen)


@pytest.mark.parametrize("quiet", [1e9, float("inf"), float("nan"), -5.0])
def test_an_announced_silence_is_bounded(quiet: float) -> None:
    """A worker cannot make itself unaccountable: at most MAX_QUIET_S per heartbeat, and a
    non-finite or negative announcement is none."""
    registry = Registry()
    worker = registry.admit(b"w", hello(), codec.tokenizer_digest(TOK),
                            tokenizer=FAKE_TOKENIZER)  # type: ignore[arg-type]
    worker.on_heartbeat(m.Heartbeat("w", m.Stats(), quiet_s=quiet))
    now = time.monotonic()
    if quiet == 1e9:
        assert worker.quiet_until == pytest.approx(now + MAX_QUIET_S, abs=0.5)
    else:
        assert worker.quiet_until == 0.0


def test_announced_silences_are_logged_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    """A worker alternating quiet and ordinary beats cannot fill the gateway's log."""
    registry = Registry()
    worker = registry.admit(b"w", hello(), codec.tokenizer_digest(TOK),
                            tokenizer=FAKE_TOKENIZER)  # type: ignore[arg-type]
    with caplog.at_level("INFO", logger="kestrel.gateway.engine"):
        for _ in range(50):
            worker.on_heartbeat(m.Heartbeat("w", m.Stats(), quiet_s=5.0))
            worker.on_heartbeat(m.Heartbeat("w", m.Stats()))
    assert len([r for r in caplog.records if "may be silent" in r.getMessage()]) == 1
