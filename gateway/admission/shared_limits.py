"""The per-client rate limit shared by every API server process (gateway.api_servers): the same
token buckets as gateway.admission.rate_limit.RateLimiter, kept in a file that all K processes map,
so a client whose connections land on different processes sees one limit, not K.

    take(client) ──blake2b(client), 8 bytes──▶ a run of PROBE slots from its hash
        ──flock on the file──▶ its slot (or an empty one, or one whose bucket has refilled: the
        same as no bucket, or else the one idle longest) ──refill, take one──▶ written back

A slot is (key 8 bytes, tokens float64, last refill float64) on CLOCK_MONOTONIC, which every
process on the host shares. SLOTS (65,536) bounds the file (1.5 MiB): past that many clients
active at once, the idlest of a run is forgotten, which gives it a full bucket again.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable

SLOTS = 1 << 16
PROBE = 8
SLOT = struct.Struct("<8sdd")
EMPTY = bytes(8)


def open_checked(path: str) -> int:
    """The shared file, opened (created 0600 if absent) only if it is what this gateway would
    have made: a regular file, not a symbolic link, owned by this user, with no access for
    group or others and no second hard link. ValueError saying which otherwise: a file planted
    at the path must not redirect the limiter's writes, nor let another user set its buckets."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if os.path.islink(path):
            raise ValueError(f"--shared-state {path}: a symbolic link; refused") from e
        raise ValueError(f"--shared-state {path}: {e.strerror}") from e
    st = os.fstat(fd)
    problem = (
        "not a regular file" if not stat.S_ISREG(st.st_mode)
        else f"owned by uid {st.st_uid}, not this user ({os.getuid()})" if st.st_uid != os.getuid()
        else f"mode {stat.S_IMODE(st.st_mode):#o} opens it to other users"
        if st.st_mode & 0o077
        else f"{st.st_nlink} hard links to it" if st.st_nlink != 1
        else None)
    if problem is not None:
        os.close(fd)
        raise ValueError(f"--shared-state {path}: {problem}; refused")
    return fd


def shared_state_problem(path: str) -> str | None:
    """Why the file at `path` cannot be the shared state (open_checked's reason), or None."""
    try:
        os.close(open_checked(path))
    except ValueError as e:
        return str(e)
    return None


class SharedRateLimiter:
    def __init__(self, path: str, rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._fd = open_checked(path)
        size = SLOTS * SLOT.size
        if os.fstat(self._fd).st_size < size:
            os.ftruncate(self._fd, size)  # zero-filled: every slot empty
        self._map = mmap.mmap(self._fd, size)

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, client: str) -> float:
        """Take one token: 0.0 if allowed, else seconds to wait for the next token."""
        if not self.enabled:
            return 0.0
        key = hashlib.blake2b(client.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        if key == EMPTY:
            key = b"\x01" + key[1:]
        first = int.from_bytes(key[:4], "little") % SLOTS
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            now = self.clock()
            slot, tokens, last = self._find(key, first, now)
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            wait = 0.0
            if tokens >= 1.0:
                tokens -= 1.0
            else:
                wait = (1.0 - tokens) / self.rate
            SLOT.pack_into(self._map, slot * SLOT.size, key, tokens, now)
            return wait
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _find(self, key: bytes, first: int, now: float) -> tuple[int, float, float]:
        """(slot, tokens, last refill) of this client's bucket; a new bucket is full."""
        spare, idlest = None, None
        for i in range(PROBE):
            slot = (first + i) % SLOTS
            held, tokens, last = SLOT.unpack_from(self._map, slot * SLOT.size)
            if held == key:
                return slot, tokens, last
            refilled = held == EMPTY or tokens + (now - last) * self.rate >= self.burst
            if spare is None and refilled:
                spare = slot
            if idlest is None or last < idlest[1]:
                idlest = (slot, last)
        assert idlest is not None
        return (spare if spare is not None else idlest[0]), float(self.burst), now

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
