"""The routing policy alone: load against capacity, prefix blocks held, override, ties."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from common.block_hash import block_hashes
from gateway.engine.router import PrefixIndex, Router
from protocol import messages as m

TOK = m.TokenizerInfo("", None, None, None, [])


@dataclass
class W:
    identity: bytes
    load: int = 0
    capacity: int = 8
    hello: m.Hello = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.hello = m.Hello(m.PROTOCOL_VERSION, self.identity.decode(), "x", 4096, 1 << 16,
                             self.capacity, TOK, block_size=4)


def prompt(prefix: int, n: int = 32, tail: int = 0) -> list[int]:
    return [prefix * 1000 + i for i in range(n)] + [7] * tail


def test_block_hashes_chain_so_equal_digests_mean_equal_prefixes() -> None:
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same 2nd block, other parent
    assert block_hashes([1, 2, 3], 4) == []  # only full blocks


def test_prefix_index_matches_leading_blocks_and_evicts_least_recent() -> None:
    idx = PrefixIndex(3)
    hs = block_hashes(list(range(16)), 4)
    idx.add(hs[:2])
    assert idx.matched(hs) == 2
    idx.add(hs[2:])  # 4 blocks into 3 places: the oldest (the chain's head) goes
    assert len(idx) == 3 and idx.matched(hs) == 0


def test_cache_aware_sends_a_shared_prefix_back_to_the_worker_that_holds_it() -> None:
    router = Router("cache_aware", rng=random.Random(0))
    workers = [W(b"a"), W(b"b"), W(b"c"), W(b"d")]
    first = {p: router.pick(workers, prompt(p)) for p in range(4)}
    for _ in range(5):
        for p in range(4):
            assert router.pick(workers, prompt(p, tail=3)) is first[p]


def test_least_loaded_ignores_the_cache() -> None:
    router = Router("least_loaded", rng=random.Random(0))
    workers = [W(b"a"), W(b"b", load=1)]
    assert all(router.pick(workers, prompt(1)) is workers[0] for _ in range(10))


def test_load_outweighs_a_cache_hit_when_clearly_unbalanced() -> None:
    router = Router("cache_aware", rng=random.Random(0))
    a, b = W(b"a"), W(b"b")
    assert router.pick([a], prompt(1)) is a and router.pick([a], prompt(2)) is a
    a.load = 6  # 0.75 of its capacity against 0: the shortest queue wins, hit or not
    assert router.pick([a, b], prompt(1)) is b
    a.load = 2  # 0.25: a hit of the whole prompt is worth more than that
    assert router.pick([a, b], prompt(2)) is a


def test_ties_are_broken_at_random_so_equal_workers_share_the_work() -> None:
    router = Router("least_loaded", rng=random.Random(1))
    workers = [W(b"a"), W(b"b"), W(b"c")]
    counts = Counter(router.pick(workers, prompt(i)).identity for i in range(300))
    assert set(counts) == {b"a", b"b", b"c"} and min(counts.values()) > 60


def test_capacity_scales_load() -> None:
    router = Router("least_loaded", rng=random.Random(0))
    big, small = W(b"big", load=4, capacity=32), W(b"small", load=2, capacity=4)
    assert router.pick([big, small], prompt(1)) is big  # 4/32 < 2/4


def test_a_forgotten_worker_starts_with_an_empty_index() -> None:
    router = Router("cache_aware", rng=random.Random(0))
    a, b = W(b"a"), W(b"b")
    assert router.pick([a], prompt(1)) is a
    router.forget(b"a")
    picks = Counter(router.pick([a, b], prompt(2 + i)).identity for i in range(40))
    assert picks[b"b"] > 0


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        Router("round_robin")


def test_a_worker_that_just_emptied_gets_its_share_of_the_next_burst() -> None:
    """Closed-loop bursts: worker a's last heartbeat, sent while its burst still ran, says 8
    running; by the time the next burst comes its requests have ended here. Its load is what
    we hold there now (0), not the beat's 8, so the burst splits evenly."""
    from gateway.engine.registry import WorkerState

    a, b = (WorkerState(name, W(name).hello, i, 0.0, ready=True) for i, name in
            enumerate((b"a", b"b")))
    a.inflight = {f"r{i}" for i in range(8)}
    a.on_heartbeat(m.Heartbeat("a", m.Stats(running=8)))
    b.on_heartbeat(m.Heartbeat("b", m.Stats()))
    a.inflight.clear()  # the burst ended; no beat since
    router = Router("cache_aware", rng=random.Random(0))
    for i in range(16):
        chosen = router.pick([a, b], prompt(100 + i))  # type: ignore[list-item]
        chosen.inflight.add(f"s{i}")
    assert (len(a.inflight), len(b.inflight)) == (8, 8)


def test_a_heartbeat_counting_more_than_ours_adds_the_difference() -> None:
    """With several API server processes a worker also runs the others' requests: its beat's
    count beyond ours stays in its load until the next beat."""
    from gateway.engine.registry import WorkerState

    w = WorkerState(b"w", W(b"w").hello, 0, 0.0, ready=True)
    w.inflight = {"ours-1", "ours-2"}
    w.on_heartbeat(m.Heartbeat("w", m.Stats(running=5, waiting=1)))
    assert w.load == 6
    w.inflight.add("ours-3")
    assert w.load == 7
