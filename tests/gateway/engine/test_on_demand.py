"""The on-demand policy (gateway/engine/on_demand.py) against a fake launcher and registry: which
model is unloaded for which, never a busy one, never more than --models-max processes, a failing
model's 503, a deadline's 504, and idle models unloaded."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from gateway.engine.on_demand import OnDemand
from gateway.http.errors import APIError


class FakeSpawner:
    """Processes that 'join' (become candidates) `join_s` after start and exit when stopped."""

    def __init__(self, models: list[str], join_s: float = 0.05) -> None:
        self.catalog = {m: f"/models/{m}.gguf" for m in models}
        self.alive: set[str] = set()
        self.failing: dict[str, str] = {}
        self.started: list[str] = []
        self.join_s = join_s
        self.joined_at: dict[str, float] = {}
        self.exit_s = 0.0  # how long a stopped process takes to exit
        self.stopped_at: dict[str, float] = {}

    def start(self, model_id: str) -> None:
        self.started.append(model_id)
        self.stopped_at.pop(model_id, None)
        if model_id in self.failing:
            return  # exits at once
        self.alive.add(model_id)
        self.joined_at[model_id] = time.monotonic() + self.join_s

    def stop(self, model_id: str) -> None:
        self.stopped_at[model_id] = time.monotonic()
        if not self.exit_s:
            self.alive.discard(model_id)

    def running(self, model_id: str) -> bool:
        gone = self.stopped_at.get(model_id, float("inf")) + self.exit_s <= time.monotonic()
        if gone:
            self.alive.discard(model_id)
        return model_id in self.alive

    def failure(self, model_id: str) -> str | None:
        return self.failing.get(model_id)


class FakeRegistry:
    def __init__(self, spawner: FakeSpawner) -> None:
        self.spawner = spawner

    @property
    def models(self) -> dict[str, object]:
        return {m: None for m in self.spawner.alive}

    def model(self, model_id: str) -> object:
        return f"entry of {model_id}" if self.candidates(model_id) else None

    def candidates(self, model_id: str) -> list[str]:
        joined = self.spawner.joined_at.get(model_id, float("inf")) <= time.monotonic()
        return [model_id] if model_id in self.spawner.alive and joined else []


def pool(models: list[str], models_max: int = 0, idle_s: float = 0.0,
         busy: dict[str, int] | None = None) -> tuple[OnDemand, FakeSpawner]:
    spawner = FakeSpawner(models)
    counts = busy if busy is not None else {}
    return OnDemand(spawner, FakeRegistry(spawner), lambda m: counts.get(m, 0),  # type: ignore
                    models_max, idle_s, CollectorRegistry()), spawner


def test_a_request_starts_its_model_and_waits_for_it_to_join() -> None:
    p, spawner = pool(["a", "b"])
    assert p.status("a") == "unloaded"
    asyncio.run(p.ensure("a", None))
    assert spawner.started == ["a"] and p.status("a") == "loaded" and p.status("b") == "unloaded"
    asyncio.run(p.ensure("a", None))  # loaded: nothing started again
    assert spawner.started == ["a"]


def test_the_least_recently_used_idle_model_makes_room_and_a_busy_one_never_does() -> None:
    busy: dict[str, int] = {}
    p, spawner = pool(["a", "b", "c"], models_max=2, busy=busy)
    for m in ("a", "b"):
        asyncio.run(p.ensure(m, None))
    asyncio.run(p.ensure("a", None))  # a used after b: b is the least recently used
    asyncio.run(p.ensure("c", None))
    assert spawner.alive == {"a", "c"} and p.unloads.labels("lru")._value.get() == 1
    busy["a"] = 1  # a has a request: c must go for b
    asyncio.run(p.ensure("b", None))
    assert spawner.alive == {"a", "b"}


def test_with_every_loaded_model_busy_a_load_waits_until_its_deadline() -> None:
    p, spawner = pool(["a", "b"], models_max=1, busy={"a": 1})
    asyncio.run(p.ensure("a", None))
    with pytest.raises(APIError) as err:
        asyncio.run(p.ensure("b", time.monotonic() + 0.3))
    assert err.value.status == 504 and spawner.alive == {"a"}


def test_a_model_whose_process_ends_answers_503_naming_why() -> None:
    p, spawner = pool(["a"])
    spawner.failing["a"] = "model refused: the GGUF file did not parse"
    with pytest.raises(APIError) as err:
        asyncio.run(p.ensure("a", None))
    assert err.value.status == 503 and err.value.code == "model_load_failed"
    assert "did not parse" in err.value.message


def test_a_manual_unload_of_a_busy_model_is_409_and_of_an_idle_one_stops_it() -> None:
    busy = {"a": 2}
    p, spawner = pool(["a"], busy=busy)
    asyncio.run(p.ensure("a", None))
    with pytest.raises(APIError) as err:
        p.unload("a")
    assert err.value.status == 409 and spawner.alive == {"a"}
    busy["a"] = 0
    p.unload("a")
    assert spawner.alive == set() and p.status("a") == "unloaded"
    with pytest.raises(APIError) as err:
        p.unload("zeta")
    assert err.value.status == 404


def test_models_idle_past_sleep_idle_seconds_are_unloaded_and_busy_ones_kept() -> None:
    busy: dict[str, int] = {}
    p, spawner = pool(["a", "b"], idle_s=0.2, busy=busy)

    async def scenario() -> None:
        await p.ensure("a", None)
        await p.ensure("b", None)
        busy["b"] = 1
        task = asyncio.create_task(p.run())
        await asyncio.sleep(0.6)
        task.cancel()

    asyncio.run(scenario())
    assert spawner.alive == {"b"} and p.unloads.labels("idle")._value.get() == 1


def test_names_outside_the_folder_are_left_to_the_route() -> None:
    p, spawner = pool(["a"])
    asyncio.run(p.ensure("not-here", None))
    assert spawner.started == []
    asyncio.run(p.ensure(None, None))  # no model named: the folder's first
    assert spawner.started == ["a"]


def test_a_model_on_its_way_out_makes_the_room_and_no_second_one_is_unloaded_for_it() -> None:
    """--models-max 2 with a and b loaded: c's request unloads one of them, waits for its
    process to exit, and leaves the other loaded (it once unloaded both while the first
    drained)."""
    p, spawner = pool(["a", "b", "c"], models_max=2)
    for m in ("a", "b"):
        asyncio.run(p.ensure(m, None))
    spawner.exit_s = 0.3
    asyncio.run(p.ensure("c", None))
    assert spawner.alive == {"b", "c"} and p.unloads.labels("lru")._value.get() == 1


def test_a_load_whose_only_waiter_left_still_ends_and_the_model_can_be_unloaded() -> None:
    """Issue 58: a client that gives up while its model loads once left the model marked
    loading for good (409 on unload, never evicted)."""
    p, spawner = pool(["a", "b"], models_max=1)
    spawner.join_s = 0.3

    async def scenario() -> None:
        waiter = asyncio.create_task(p.ensure("b", None))
        await asyncio.sleep(0.1)  # b is loading
        waiter.cancel()  # its client left
        end = time.monotonic() + 5
        while p.status("b") != "loaded":
            assert time.monotonic() < end
            await asyncio.sleep(0.05)

    asyncio.run(scenario())
    p.unload("b")  # nothing holds it
    assert spawner.alive == set() and p.unloads.labels("manual")._value.get() == 1
    asyncio.run(asyncio.wait_for(p.ensure("a", None), 5))
    assert spawner.alive == {"a"}


def test_a_model_a_waiter_left_is_evicted_for_another_models_request() -> None:
    p, spawner = pool(["a", "b"], models_max=1)
    spawner.join_s = 0.3

    async def scenario() -> None:
        waiter = asyncio.create_task(p.ensure("b", None))
        await asyncio.sleep(0.1)
        waiter.cancel()
        await asyncio.wait_for(p.ensure("a", time.monotonic() + 5), 5)

    asyncio.run(scenario())
    assert spawner.alive == {"a"} and spawner.started == ["b", "a"]


def test_a_granted_claim_keeps_its_model_loaded_until_it_is_released() -> None:
    p, spawner = pool(["a", "b"], models_max=1)
    asyncio.run(p.ensure("a", None))
    mine = p.claim("a", None)
    assert mine.granted
    rival = p.claim("b", None)
    p.poll()
    assert spawner.alive == {"a"} and not rival.granted  # a is not evicted under mine
    mine.release()
    asyncio.run(asyncio.wait_for(rival.wait(), 5))
    assert spawner.alive == {"b"}
    rival.release()


def test_loads_follow_arrivals_a_later_request_for_a_loaded_model_waits_behind_a_swap() -> None:
    busy: dict[str, int] = {}
    p, spawner = pool(["a", "b"], models_max=1, busy=busy)
    asyncio.run(p.ensure("a", None))
    busy["a"] = 1  # a request of a's runs
    first_b = p.claim("b", None)  # the head: needs a swap, waits for a to drain
    later_a = p.claim("a", None)
    assert not first_b.granted and not later_a.granted  # no jumping the head
    busy["a"] = 0  # a drained: a is evicted for b, although later_a waits for it

    async def scenario() -> None:
        await asyncio.wait_for(first_b.wait(), 5)
        assert spawner.alive == {"b"} and not later_a.granted
        first_b.release()
        await asyncio.wait_for(later_a.wait(), 5)
        later_a.release()

    asyncio.run(scenario())
    assert spawner.started == ["a", "b", "a"]  # one load per change of the head's model


def test_a_model_loaded_for_waiting_requests_serves_them_before_it_is_evicted() -> None:
    p, spawner = pool(["a", "b"], models_max=1)
    spawner.join_s = 0.2
    for_b = p.claim("b", None)  # b starts loading for it
    head_a = p.claim("a", None)  # arrives during b's load: the next head

    async def scenario() -> None:
        await asyncio.wait_for(for_b.wait(), 5)
        p.poll()
        assert spawner.alive == {"b"}  # not evicted before for_b took its place
        for_b.release()
        await asyncio.wait_for(head_a.wait(), 5)
        head_a.release()

    asyncio.run(scenario())
    assert spawner.started == ["b", "a"]


def test_a_deadline_its_models_load_time_does_not_fit_is_refused_before_the_load() -> None:
    p, spawner = pool(["a"])
    spawner.join_s = 0.3
    asyncio.run(p.ensure("a", None))  # a load takes ~0.3 s
    p.unload("a")
    asyncio.run(asyncio.sleep(0.01))
    with pytest.raises(APIError) as err:
        asyncio.run(p.ensure("a", time.monotonic() + 0.1))
    assert err.value.status == 400 and err.value.code == "deadline_unreachable"
    assert spawner.started == ["a"]  # no load started for it


def test_a_tokenizing_route_never_loads_a_model_and_keeps_its_last_workers_tokenizer() -> None:
    p, spawner = pool(["a"])
    with pytest.raises(APIError) as err:
        p.tokenizer_entry("a")  # never loaded: its tokenizer comes with its worker
    assert err.value.status == 409 and err.value.code == "model_not_loaded"
    assert spawner.started == []
    asyncio.run(p.ensure("a", None))
    assert p.tokenizer_entry("a") is None  # served: the registry's
    p.unload("a")
    assert p.tokenizer_entry("a") == "entry of a" and spawner.started == ["a"]
    assert p.tokenizer_entry("elsewhere") is None  # not the folder's: the route's
