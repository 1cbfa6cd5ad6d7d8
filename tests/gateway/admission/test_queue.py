"""gateway/admission/queue.py: bounded, FIFO, refusing at once when full, and leak-free whichever
way a waiter leaves (granted, cancelled, timed out, cancelled just as it was granted)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from gateway.admission.queue import Admission, QueueFull, Slot


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 5))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_admits_up_to_the_limit_without_waiting() -> None:
    async def body() -> None:
        adm = Admission(lambda: 2, max_queue=4)
        slots = [await adm.acquire(), await adm.acquire()]
        assert adm.outstanding == 2 and adm.waiting == 0
        slots[0].release()
        assert adm.outstanding == 1

    run(body)


def test_waiters_get_slots_in_arrival_order() -> None:
    async def body() -> None:
        adm = Admission(lambda: 1, max_queue=3)
        first = await adm.acquire()
        order: list[int] = []

        async def wait(i: int) -> Slot:
            slot = await adm.acquire()
            order.append(i)
            return slot

        tasks = [asyncio.create_task(wait(i)) for i in range(3)]
        await settle()
        assert adm.waiting == 3 and order == []
        first.release()
        for expected in range(3):
            slot = await tasks[expected]
            assert order == list(range(expected + 1)) and adm.outstanding == 1
            slot.release()
        assert adm.outstanding == 0 and adm.waiting == 0

    run(body)


def test_a_full_queue_raises_at_once() -> None:
    async def body() -> None:
        adm = Admission(lambda: 1, max_queue=1)
        await adm.acquire()
        queued = asyncio.create_task(adm.acquire())
        await settle()
        assert adm.queue_full
        start = time.monotonic()
        with pytest.raises(QueueFull):
            await adm.acquire()
        assert time.monotonic() - start < 0.01
        assert adm.waiting == 1 and adm.outstanding == 1
        queued.cancel()

    run(body)


def test_no_queue_means_refusing_as_soon_as_the_limit_is_reached() -> None:
    async def body() -> None:
        adm = Admission(lambda: 1, max_queue=0)
        await adm.acquire()
        with pytest.raises(QueueFull):
            await adm.acquire()

    run(body)


def test_cancelling_a_queued_waiter_gives_its_place_back() -> None:
    async def body() -> None:
        adm = Admission(lambda: 1, max_queue=2)
        running = await adm.acquire()
        leaving = asyncio.create_task(adm.acquire())
        staying = asyncio.create_task(adm.acquire())
        await settle()
        leaving.cancel()
        await settle()
        assert adm.waiting == 1 and not adm.queue_full
        running.release()
        slot = await staying
        assert adm.outstanding == 1
        slot.release()
        assert adm.outstanding == 0

    run(body)


def test_cancelled_just_as_a_slot_was_granted_returns_the_slot() -> None:
    async def body() -> None:
        adm = Admission(lambda: 1, max_queue=1)
        running = await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await settle()
        running.release()  # grants the slot to the waiter, which has not run yet...
        waiter.cancel()  # ...and is cancelled before it does
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert adm.outstanding == 0 and adm.waiting == 0

    run(body)


def test_a_waiter_past_its_timeout_leaves_the_queue() -> None:
    async def body() -> None:
        adm = Admission(lambda: 1, max_queue=1)
        running = await adm.acquire()
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await adm.acquire(timeout=0.05)
        assert 0.04 < time.monotonic() - start < 0.5
        assert adm.waiting == 0
        running.release()
        assert adm.outstanding == 0
        (await adm.acquire(timeout=0.05)).release()  # a free slot needs no waiting

    run(body)


def test_release_is_idempotent() -> None:
    async def body() -> None:
        adm = Admission(lambda: 2, max_queue=0)
        slot = await adm.acquire()
        other = await adm.acquire()
        slot.release()
        slot.release()
        assert adm.outstanding == 1
        other.release()
        assert adm.outstanding == 0

    run(body)


def test_the_limit_is_read_each_time_and_poke_admits_waiters() -> None:
    async def body() -> None:
        limit = [1]
        adm = Admission(lambda: limit[0], max_queue=2)
        await adm.acquire()
        waiters = [asyncio.create_task(adm.acquire()) for _ in range(2)]
        await settle()
        assert adm.waiting == 2
        limit[0] = 3  # a worker joined
        adm.poke()
        await asyncio.gather(*waiters)
        assert adm.outstanding == 3 and adm.waiting == 0

    run(body)


def test_a_zero_limit_still_admits_one() -> None:
    """No worker has announced capacity yet: one request may go on (to find out it gets 503)."""
    async def body() -> None:
        adm = Admission(lambda: 0, max_queue=0)
        await adm.acquire()
        with pytest.raises(QueueFull):
            await adm.acquire()

    run(body)
