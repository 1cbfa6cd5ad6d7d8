"""A one-line progress display on stderr, redrawn in place with `\\r` (no extra dependency).

The runner calls `update` whenever a request is sent or finishes; redraws are throttled so a fast
run does not spend its time writing to the terminal. A disabled Progress does nothing, which keeps
the runner free of `if progress:` branches.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int | None, *, enabled: bool = True, stream: TextIO | None = None,
                 label: str = "", min_interval_s: float = 0.1) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.min_interval_s = min_interval_s
        self.sent = self.done = self.rejected = self.errors = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._width = 0  # of the longest line drawn: a shorter one is padded to cover it

    def on_sent(self) -> None:
        self.sent += 1
        self._draw()

    def on_done(self, *, rejected: bool, failed: bool) -> None:
        self.done += 1
        self.rejected += rejected
        self.errors += failed
        self._draw()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        if self.total:
            width = 24
            filled = int(width * self.done / self.total)
            bar = f"[{'#' * filled}{'-' * (width - filled)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done} done"
        return (f"{self.label}{bar} sent {self.sent} | 429 {self.rejected} | "
                f"err {self.errors} | {elapsed:6.1f}s")

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last_draw < self.min_interval_s):
            return
        self._last_draw = now
        line = self.line()
        self._width = max(self._width, len(line))
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
