"""A request in flight on the engine link, as the HTTP side sees it: the events its worker
sends (token frames, errors), and the two the link itself puts there (WorkerLost, Stopping).

The handle keeps the Generate it was sent with and a monotonic deadline, so that the link can
send it once more to another worker (with the time then left) when its worker is lost before any
frame came back.

It counts what its worker sent per choice (`tokens`, `ended`): gateway.engine.engine_client checks
each token frame against what the request asked, so that its queue is bounded by the request itself.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from gateway.engine.registry import WorkerState
from protocol import messages as m


class NoWorkerError(RuntimeError):
    """No ready worker serves the model (with a context that fits the request)."""


@dataclass(frozen=True)
class WorkerLost:
    """Event put on a request's queue when its worker died or went silent."""

    reason: str


@dataclass(frozen=True)
class Stopping:
    """Event put on every request's queue when the gateway's drain timeout passes."""

    reason: str


class RequestHandle:
    def __init__(self, gen: m.Generate, worker: WorkerState, deadline: float | None,
                 vocab_size: int | None = None) -> None:
        self.request_id = gen.request_id
        self.gen = gen
        self.worker = worker
        self.deadline = deadline  # monotonic; None: none
        self.vocab_size = vocab_size  # token ids are in range(vocab_size); None: unchecked
        self.events: asyncio.Queue[m.TokenOutput | m.RequestError | WorkerLost | Stopping] = \
            asyncio.Queue()
        self.closed = False
        self.answered = False  # a frame came back: it can no longer be retried elsewhere
        self.retried = False
        self.tokens = [0] * gen.params.n  # per choice, taken so far
        self.ended = [False] * gen.params.n  # the worker sent the choice's last frame

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


