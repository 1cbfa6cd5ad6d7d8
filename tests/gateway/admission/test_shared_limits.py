"""gateway/admission/shared_limits.py: the rate limit that several API server processes share
through one file. Two limiters on one file stand for two processes (flock excludes open file
descriptions, not only processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.admission.rate_limit import RateLimiter
from gateway.admission.shared_limits import PROBE, SLOTS, SharedRateLimiter, shared_state_problem
from tests.procs import free_port


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


def test_a_planted_symbolic_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    link = tmp_path / "limits"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        SharedRateLimiter(str(link), rate=1.0, burst=1)
    assert target.read_bytes() == b"precious"  # not truncated, not grown to 1.5 MiB


@pytest.mark.parametrize("plant,reason", [
    (lambda p: (p.write_bytes(b""), p.chmod(0o666)), "opens it to other users"),
    (lambda p: (p.write_bytes(b""), p.chmod(0o600), os.link(p, p.with_name("second"))),
     "2 hard links"),
    (lambda p: p.mkdir(), "Is a directory"),
])
def test_a_file_another_user_could_write_or_read_is_refused(tmp_path: Path, plant, reason: str
                                                            ) -> None:  # noqa: ANN001
    path = tmp_path / "limits"
    plant(path)
    assert reason in (shared_state_problem(str(path)) or "")
    with pytest.raises(ValueError, match=reason):
        SharedRateLimiter(str(path), rate=1.0, burst=1)


def test_the_file_a_gateway_makes_for_itself_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "limits"
    assert shared_state_problem(str(path)) is None  # created 0600, ours, one link
    assert SharedRateLimiter(str(path), rate=1.0, burst=1).take("c") == 0.0


def test_a_gateway_given_a_symbolic_link_exits_2_in_one_line(tmp_path: Path) -> None:
    """The real gateway process, as an operator would start it."""
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    (tmp_path / "limits").symlink_to(target)
    done = subprocess.run([sys.executable, "-m", "gateway.main", "--port", str(free_port()),
                           "--insecure-link", "--shared-state", str(tmp_path / "limits")],
                          cwd=Path(__file__).resolve().parents[3], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "symbolic link" in lines[0], done.stderr[-2000:]
    assert target.read_bytes() == b"precious"
