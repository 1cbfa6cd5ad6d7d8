"""gateway/shared_limits.py: the rate limit that several API server processes share through one
file. Two limiters on one file stand for two processes (flock excludes open file descriptions,
not only processes)."""

from __future__ import annotations

from pathlib import Path

from gateway.rate_limit import RateLimiter
from gateway.shared_limits import PROBE, SLOTS, SharedRateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_two_processes_draw_from_one_bucket_per_client(tmp_path: Path) -> None:
    clock = Clock()
    a = SharedRateLimiter(str(tmp_path / "limits"), 1.0, 4, clock)
    b = SharedRateLimiter(str(tmp_path / "limits"), 1.0, 4, clock)
    takes = [(a if i % 2 else b).take("client-1") for i in range(8)]
    assert [t == 0.0 for t in takes] == [True] * 4 + [False] * 4  # one burst of 4, not two
    assert b.take("client-2") == 0.0  # another client has its own bucket
    clock.now += 2.0  # two tokens back, whichever process looks
    assert [a.take("client-1"), b.take("client-1")] == [0.0, 0.0]
    assert a.take("client-1") > 0


def test_it_gives_what_the_in_process_limiter_gives(tmp_path: Path) -> None:
    clock = Clock()
    shared = SharedRateLimiter(str(tmp_path / "limits"), 2.5, 3, clock)
    local = RateLimiter(2.5, 3, clock)
    for step in range(40):
        clock.now += 0.13 * (step % 4)
        client = f"c{step % 3}"
        assert abs(shared.take(client) - local.take(client)) < 1e-9


def test_a_full_run_of_slots_forgets_the_idlest_client(tmp_path: Path) -> None:
    clock = Clock()
    limiter = SharedRateLimiter(str(tmp_path / "limits"), 0.001, 1, clock)
    # Find PROBE + 1 clients whose runs start at the same slot: the last one finds no room.
    import hashlib

    def first(c: str) -> int:
        return int.from_bytes(hashlib.blake2b(c.encode(), digest_size=8).digest()[:4],
                              "little") % SLOTS

    target = first("c0")
    same = [c for c in (f"c{i}" for i in range(2_000_000)) if first(c) == target][:PROBE + 1]
    assert len(same) == PROBE + 1
    for c in same[:PROBE]:
        clock.now += 1
        assert limiter.take(c) == 0.0
    clock.now += 1
    assert limiter.take(same[PROBE]) == 0.0  # took the idlest's slot: a fresh bucket
    assert limiter.take(same[0]) == 0.0  # the idlest was forgotten: full again
    assert limiter.take(same[PROBE - 1]) > 0  # the others still drew their token
