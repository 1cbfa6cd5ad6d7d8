"""One request's life at the gateway once it is admitted, whatever the route.

    Generation.events():  worker frames ──(a backlog: taken at once, one choice's consecutive
    frames joined)──▶ per-choice IncrementalDetokenizer (UTF-8 and stop string holdback) ──▶
    ChoiceEvent(index, text, finish_reason) ──▶ the route's formatter

A deadline, where the request has one, bounds every wait: past it, unfinished choices end with
finish_reason "timeout" and the worker is told to cancel. A lost worker or an engine refusal
raises EngineFailure, which the route turns into an error response or a stream error event.
`close()` is idempotent and always runs: it cancels at the worker if the request is still live
there. The admission slot is not the generation's: its owner (gateway.api.exchange) releases it
after close(), with what `worker_id` and `ran` say was served.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from gateway.engine.engine_client import (
    EngineClient,
    ModelEntry,
    RequestHandle,
    Stopping,
    WorkerLost,
)
from gateway.output.detokenize import IncrementalDetokenizer
from gateway.output.timings import Timings
from protocol import messages as m

T = TypeVar("T")


_ids = itertools.count()


def new_request_id() -> str:
    """The engine's id of a request: unique across workers and gateway restarts (a random
    prefix plus a counter)."""
    return f"{uuid.uuid4().hex[:12]}-{next(_ids)}"


class EngineFailure(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclass
class ChoiceEvent:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[list] | None = None
    finish_reason: str | None = None
    embedding: bytes | None = None  # an embedding request's vector (float32 little-endian)


async def _get_before(queue: asyncio.Queue[T], deadline: float | None) -> T:
    """The next item, or TimeoutError once `deadline` (monotonic; None: never) passes.

    Not asyncio.wait_for: before Python 3.12 it can swallow a cancellation that arrives as the
    item does, and a request whose client left would go on waiting for frames until its deadline.
    """
    if deadline is None:
        return await queue.get()
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    getter = asyncio.ensure_future(queue.get())
    try:
        done, _ = await asyncio.wait({getter}, timeout=remaining)
    finally:
        if not getter.done():
            getter.cancel()
    if not done:
        raise TimeoutError
    return getter.result()


Event = m.TokenOutput | m.RequestError | WorkerLost | Stopping


def _joined(frames: list[m.TokenOutput]) -> m.TokenOutput:
    """Consecutive frames of one choice as one: a route that fell behind the worker sends them
    as one event, so its per-event work (detokenizing, JSON, the write) is paid once for the
    backlog rather than once per token. The last frame's counts and finish, the first's timing."""
    last = frames[-1]
    ids = [t for f in frames for t in f.token_ids]
    logprobs = None
    if any(f.logprobs is not None for f in frames):
        logprobs = [e for f in frames for e in (f.logprobs or [])]
    since = next((f.since_scheduled_s for f in frames if f.since_scheduled_s is not None), None)
    return m.TokenOutput(last.request_id, last.index, ids, last.finish_reason, last.prompt_tokens,
                         last.completion_tokens, logprobs, last.cached_tokens, since)


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    tokens: int = 0
    finish_reason: str | None = None
    worker_done: bool = False  # the worker sent this choice's last frame


class Generation:
    def __init__(self, client: EngineClient, model: ModelEntry, prompt_ids: list[int],
                 params: m.SamplingParams, stop: list[str], deadline: float | None,
                 arrival: float, grammar: str | None = None, cache_salt: str = "",
                 skip_special_tokens: bool = True, include_stop: bool = False,
                 input_lengths: list[int] | None = None, request_id: str | None = None) -> None:
        self.client = client
        self.model = model
        self.request_id = request_id or new_request_id()  # the engine's id of it
        self.prompt_ids = prompt_ids
        self.params = params
        self.deadline = deadline  # monotonic; None: none
        self.ran = 1.0  # the share of what it asked for that ran (less: its client left early)
        self.worker_id: str | None = None  # the worker that ended it, once closed
        self.timed_out = False  # a choice ended by the deadline (ours or the worker's)
        self.timings = Timings(arrival)
        self.choices = [_Choice(IncrementalDetokenizer(model.tokenizer, stop, skip_special_tokens,
                                                       include_stop))
                        for _ in range(params.n)]
        self.cached_tokens = 0
        self.handle: RequestHandle | None = None
        self._live = False  # the worker may still be generating for us
        self.grammar = grammar  # llguidance grammar for the worker's mask; None: free text
        self.traceparent: str | None = None  # set by the tracer before start(); None: off
        self.cache_salt = cache_salt  # the prefix cache's tenant (gateway/prompt/tenancy.py)
        self.input_lengths = input_lengths or []  # embeddings: one vector per input, no tokens
        self._backlog: deque[Event] = deque()  # frames taken from the queue, not yet handled
        # Frames are joined only without stop strings: a stop met inside a joined frame would
        # count the tokens after it in the usage, which one frame at a time does not.
        self._joinable = not stop

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def longest_choice(self) -> int:
        """Tokens of the choice that has the most so far (admission's backlog reads it)."""
        return max(c.tokens for c in self.choices)

    @property
    def finish_reasons(self) -> list[str | None]:
        return [c.finish_reason for c in self.choices]

    def usage(self) -> dict[str, object]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    async def start(self) -> None:
        # The link sends the time left (timeout_s), never a wall-clock instant: the worker's
        # clock need not agree with ours.
        gen = m.Generate(self.request_id, self.prompt_ids, self.params,
                         grammar=self.grammar, traceparent=self.traceparent,
                         cache_salt=self.cache_salt, embed=bool(self.input_lengths),
                         input_lengths=self.input_lengths)
        # Taken before the await: once it yields, a busy loop may resume us after the worker
        # has already answered.
        self.timings.sent = time.monotonic()
        self.handle = await self.client.submit(self.model.model_id, gen, self.deadline)
        self._live = True

    async def _next_event(self) -> Event:
        """The next frame: from the backlog when the route fell behind (no wait, no timer; one
        choice's consecutive token frames joined into one), else waited for until the deadline
        (TimeoutError)."""
        assert self.handle is not None
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise TimeoutError
        backlog, queue = self._backlog, self.handle.events
        if not backlog:
            if queue.empty():
                return await _get_before(queue, self.deadline)
            while not queue.empty():
                backlog.append(queue.get_nowait())
        event = backlog.popleft()
        if not (self._joinable and backlog and isinstance(event, m.TokenOutput)):
            return event
        run = [event]
        while (backlog and run[-1].finish_reason is None and isinstance(backlog[0], m.TokenOutput)
               and backlog[0].index == event.index):
            run.append(backlog.popleft())
        return event if len(run) == 1 else _joined(run)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        assert self.handle is not None
        while any(c.finish_reason is None for c in self.choices):
            try:
                event = await self._next_event()
            except TimeoutError:
                for i, choice in enumerate(self.choices):
                    if choice.finish_reason is None:
                        choice.finish_reason = "timeout"
                        self.timed_out = True
                        yield ChoiceEvent(i, choice.detok.flush(), [], None, "timeout")
                await self.close()
                return
            if isinstance(event, Stopping):  # still live at the worker: close() cancels it
                raise EngineFailure(503, event.reason, "shutting_down")
            if isinstance(event, WorkerLost):
                self._live = False
                raise EngineFailure(503, f"the worker serving this request was lost "
                                         f"({event.reason})", "worker_lost")
            if isinstance(event, m.RequestError):
                self._live = False
                status = {"invalid_request": 400, "unavailable": 503,
                          "bad_worker_frame": 502}.get(event.code, 500)
                raise EngineFailure(status, event.message, event.code)
            out = self._on_output(event)
            if out is None:
                continue
            choice = self.choices[out.index]
            if out.finish_reason == "stop" and not choice.worker_done and any(
                    c.finish_reason is None for c in self.choices):
                # A stop string, seen here: the worker would go on generating this choice until
                # its siblings end. (When none is left, close() cancels the whole request.)
                await self.client.cancel_choice(self.handle, out.index)
            yield out
        await self.close()

    def _on_output(self, out: m.TokenOutput) -> ChoiceEvent | None:
        if not 0 <= out.index < len(self.choices):
            return None
        choice = self.choices[out.index]
        choice.worker_done = choice.worker_done or out.finish_reason is not None
        if choice.finish_reason is not None:
            return None  # e.g. tokens after a stop string, before our cancel arrived
        if out.token_ids:
            self.timings.on_tokens(out.index, len(out.token_ids), time.monotonic(),
                                   out.since_scheduled_s)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        choice.tokens += len(out.token_ids)
        text = choice.detok.add(out.token_ids)
        finish = None
        if choice.detok.stopped:
            finish = "stop"
        elif out.finish_reason is not None:
            finish = out.finish_reason
            text += choice.detok.flush()
            self.timed_out = self.timed_out or finish == "timeout"
        choice.finish_reason = finish
        return ChoiceEvent(out.index, text, list(out.token_ids), out.logprobs, finish,
                           out.embedding)

    async def close(self) -> None:
        """Idempotent: stop the work at the worker if it may still run; `worker_id` says which
        worker ended it (read here, not at start: a retry may have moved it)."""
        if self.handle is not None:
            self.worker_id = self.handle.worker.hello.worker_id
            if self._live and not all(c.worker_done for c in self.choices):
                if any(c.finish_reason is None for c in self.choices):
                    # Its client left before its end (a stop string or a deadline is an end):
                    # what ran of what it asked for.
                    self.ran = self.longest_choice() / max(1, self.params.max_tokens)
                await self.client.cancel(self.handle)
            else:
                self.client.release(self.handle)
            self._live = False
