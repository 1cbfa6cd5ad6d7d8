"""gateway/offload.py: each kind of blocking work has its own bounded room and threads."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from gateway import offload
from gateway.offload import Busy, LoopLag, Pool


def test_a_full_kind_refuses_at_once_and_frees_its_room_when_jobs_end() -> None:
    pool = Pool("test", threads=1, waiting=1)
    gate = threading.Event()

    async def main() -> None:
        jobs = [asyncio.create_task(pool.run(gate.wait)) for _ in range(2)]  # 1 runs, 1 waits
        await asyncio.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(Busy, match="too many test jobs at once"):
            await pool.run(lambda: None)
        assert time.monotonic() - start < 0.05  # refused, not queued
        gate.set()
        assert await asyncio.gather(*jobs) == [True, True]
        assert pool.busy == 0
        assert await pool.run(lambda: 7) == 7

    asyncio.run(main())


def test_one_client_gets_its_share_of_an_expensive_kind_and_others_still_get_in() -> None:
    pool = Pool("grammar", threads=1, waiting=4, per_client=1)
    gate = threading.Event()

    async def main() -> None:
        first = asyncio.create_task(pool.run(gate.wait, client="alice"))
        await asyncio.sleep(0.02)
        with pytest.raises(Busy) as exc:
            await pool.run(lambda: None, client="alice")
        assert exc.value.per_client and "from this client" in str(exc.value)
        bob = asyncio.create_task(pool.run(lambda: "bob", client="bob"))  # waits, not refused
        gate.set()
        assert await first is True and await bob == "bob"
        assert pool.by_client == {} and await pool.run(lambda: 1, client="alice") == 1

    asyncio.run(main())


def test_a_job_error_reaches_its_caller_and_the_thread_lives_on() -> None:
    pool = Pool("test", threads=1, waiting=1)

    def boom() -> None:
        raise ValueError("bad schema")

    async def main() -> None:
        with pytest.raises(ValueError, match="bad schema"):
            await pool.run(boom)
        assert await pool.run(lambda: "after") == "after"

    asyncio.run(main())


def test_a_caller_that_gives_up_keeps_the_room_until_the_job_ends() -> None:
    pool = Pool("test", threads=1, waiting=0)
    gate = threading.Event()

    async def main() -> None:
        job = asyncio.create_task(pool.run(gate.wait))
        await asyncio.sleep(0.02)
        job.cancel()  # its client left
        await asyncio.sleep(0.02)
        with pytest.raises(Busy):  # the thread is still busy with it
            await pool.run(lambda: None)
        gate.set()
        for _ in range(100):
            if pool.busy == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.busy == 0

    asyncio.run(main())


def test_an_error_of_a_job_whose_caller_gave_up_is_not_logged_as_never_retrieved() -> None:
    pool = Pool("test", threads=1, waiting=0)
    gate = threading.Event()
    unhandled: list[dict] = []

    def fails() -> None:
        gate.wait()
        raise ValueError("the template failed")

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: unhandled.append(ctx))
        job = asyncio.create_task(pool.run(fails))
        await asyncio.sleep(0.02)
        job.cancel()  # its client left while the template rendered
        gate.set()
        for _ in range(100):
            if pool.busy == 0:
                break
            await asyncio.sleep(0.01)
        await pool.run(lambda: None)  # the thread lets go of the failed job's future

    asyncio.run(main())
    gc.collect()  # "never retrieved" is reported when the job's future is collected
    assert unhandled == []


def test_one_keys_slow_jobs_leave_a_thread_for_other_keys_and_wait_their_turn() -> None:
    pool = Pool("test", threads=2, waiting=8, per_key=1)
    gate = threading.Event()
    running: list[str] = []

    def slow(name: str) -> str:
        running.append(name)
        gate.wait()
        return name

    async def main() -> None:
        evil = [asyncio.create_task(pool.run(slow, f"evil{i}", key="evil")) for i in range(3)]
        await asyncio.sleep(0.05)
        assert running == ["evil0"]  # one thread for the slow model; its others wait in order
        assert await asyncio.wait_for(pool.run(lambda: "served", key="calm"), 1) == "served"
        gate.set()
        assert await asyncio.gather(*evil) == ["evil0", "evil1", "evil2"]
        assert running == ["evil0", "evil1", "evil2"] and pool.busy == 0

    asyncio.run(main())


def test_the_threads_are_daemons_so_a_stuck_job_never_blocks_exit() -> None:
    async def main() -> None:
        await offload.run("hello", lambda: None)

    asyncio.run(main())
    threads = [t for t in threading.enumerate() if t.name.startswith("hello-")]
    assert threads and all(t.daemon for t in threads)


def test_loop_lag_sees_a_blocked_loop() -> None:
    seen: list[float] = []

    async def main() -> None:
        watch = asyncio.create_task(LoopLag(seen.append, period=0.02).watch())
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # something blocks the loop
        await asyncio.sleep(0.05)
        watch.cancel()

    asyncio.run(main())
    assert max(seen) >= 0.15 and min(seen) < 0.05
