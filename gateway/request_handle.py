"""A request in flight on the engine link, as the HTTP side sees it: the events its worker
sends (token frames, errors), and the two the link itself puts there (WorkerLost, Stopping).

The handle keeps the Generate it was sent with and a monotonic deadline, so that the link can
send it once more to another worker (with the time then left) when its worker is lost before any
frame came back.

A worker is trusted with its model's output, never with the gateway: `refuse` checks each token
frame against what the request asked (its choices, its max_tokens, the model's vocabulary), so
that what a request's queue holds is bounded by the request itself, whatever the worker sends.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass

from gateway.registry import WorkerState
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
        self._tokens = [0] * gen.params.n  # per choice, taken so far
        self._ended = [False] * gen.params.n  # the worker sent the choice's last frame

    def refuse(self, out: m.TokenOutput) -> str | None:
        """Why no honest worker sends this frame for this request; None: it is taken (and
        counted). At most max_tokens tokens and one last frame per choice get through."""
        n, i = len(self._tokens), out.index
        if not 0 <= i < n:
            return f"a frame for choice {i} of a request with n={n}"
        if self._ended[i]:
            return f"a frame for choice {i} after its last"
        if not out.token_ids and out.finish_reason is None:
            return "a frame with no token and no finish"
        total = self._tokens[i] + len(out.token_ids)
        if total > self.gen.params.max_tokens:
            return (f"{total} tokens for choice {i}, over the request's max_tokens of "
                    f"{self.gen.params.max_tokens}")
        vocab = self.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in out.token_ids):
            return f"a token id outside the model's vocabulary of {vocab}"
        if out.logprobs is not None and len(out.logprobs) != len(out.token_ids):
            return f"{len(out.logprobs)} logprob entries for {len(out.token_ids)} tokens"
        self._tokens[i] = total
        self._ended[i] = out.finish_reason is not None
        return None

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


_ids = itertools.count()


def new_request_id() -> str:
    # Unique across workers and gateway restarts: random prefix plus a counter.
    return f"{uuid.uuid4().hex[:12]}-{next(_ids)}"

