"""The worker's thread count, chosen from its own decode steps while it serves (issue 21).

Quiet, the kernels' threads share each matmul and a step is fastest with all of them. Beside a
process that holds a core (the gateway under `kestrel serve`, anything else on the host), each
of the ~150 parallel regions of a step waits at its end for the thread the OS took off that
core. Measured on the Ice Lake (2 vCPUs) with a process spinning on one core: 1 thread served
16 streams at 91 tok/s (ITL 20.6 ms) where 2 threads served 47 (28.6 ms); quiet, 2 threads are
faster. Which holds is a property of the host at the moment, so it is measured, not assumed:

    after each decode-only step: its time into a running mean for (threads, rows bucket)
    every `every` decode steps (the first after `first`): `probe` steps at each other count
    after a probe: the count with the least mean at the current rows bucket, if it beats the
    one running by `margin` (so noise does not flip it back and forth); the change is logged

The step just after a change is not counted (threads waking). Only where a step's numerics do
not depend on the thread count (the decode stack's kernels split work by output tile or by
sequence and head, never a sum): model_runner turns it on there, with --threads 0 (the default).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("kestrel.threads")

ALPHA = 0.25  # weight of a new step time in a running mean


def _bucket(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()  # 1, 2, 4, 8, ...


class ThreadChoice:
    def __init__(self, most: int, every: int = 256, probe: int = 8, first: int = 32,
                 margin: float = 0.05,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        if most < 2:
            raise ValueError("a thread choice needs at least 2 threads to choose from")
        self.candidates = sorted({most, max(1, most // 2), 1}, reverse=True)
        self.every, self.probe, self.margin = every, probe, margin
        self.set_threads = set_threads
        self.current = self.running = most
        self.means: dict[tuple[int, int], float] = {}
        self.until_probe = first
        self.queue: list[int] = []  # the counts of the probe steps still to run
        self.settling = False

    def threads(self) -> int:
        """The count for the next step, set in torch if it changes."""
        want = self.queue[0] if self.queue else self.current
        if want != self.running:
            self.set_threads(want)
            self.running, self.settling = want, True
        return want

    def record(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds` at the running count."""
        bucket = _bucket(rows)
        if self.settling:
            self.settling = False
        else:
            key = (self.running, bucket)
            old = self.means.get(key)
            self.means[key] = seconds if old is None else old + ALPHA * (seconds - old)
        if self.queue:
            if self.queue[0] == self.running:
                self.queue.pop(0)
            if not self.queue:
                self._decide(bucket)
            return
        self.until_probe -= 1
        if self.until_probe <= 0:
            self.until_probe = self.every
            # one more step each: the first after a change is not counted
            self.queue = [t for t in self.candidates if t != self.current
                          for _ in range(self.probe + 1)]

    def _decide(self, bucket: int) -> None:
        here = {t: self.means[(t, bucket)] for t in self.candidates if (t, bucket) in self.means}
        if self.current not in here:
            return
        best = min(here, key=here.__getitem__)
        if best != self.current and here[best] < here[self.current] * (1 - self.margin):
            log.info("decode steps of %d rows: %d threads (%.1f ms a step) where %d took %.1f ms",
                     bucket, best, here[best] * 1e3, self.current, here[self.current] * 1e3)
            self.current = best
