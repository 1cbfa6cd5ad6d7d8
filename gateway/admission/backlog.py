"""The work admitted and not yet done, per model, and when a new request would finish behind it:
what admission decides a deadline with.

    Admitter.reserve ──Backlog.add(Work)──▶ decide(work): its finish, and what it costs the
    deadlines admitted before it ──▶ tokenized: decided again with its exact prompt ──▶ running:
    Work.generated reads the Generation's tokens ──▶ its slot (or ticket) given back: remove

Every figure comes from the costs the model's workers measure on their own steps and send in
their Hello and heartbeats (m.StepCosts, engine_worker.step_costs), never from a few finished
requests: a first request's rate is no rate for sixteen. A step's time is its decode rows' cost
plus its prompt rows' (the worker adds them to fill a step), so time until a request's last token
is a sum of work, FCFS:
- every prompt row ahead of it and its own (running, prefilling, queued, or a burst still being
  tokenized, whose prompt then counts as its characters), at the measured cost of a row in the
  chunks of tens of rows a shared step carries;
- its decode steps: those until a seat frees (the requests ahead played on the model's seats in
  FCFS order, each holding its seat for all of its max_tokens: an early stop only frees it
  sooner) and its own max_tokens, each at the measured decode step of that many sequences;
- plus what requests admitted after it add: their prompt rows, and one more decode row in each
  step. Those are counted as they come: each request with a deadline keeps its slack (deadline
  minus its finish, at admission), every later admission spends its cost from all of them, and
  one that would spend more than some admitted request has left is refused (429). So a burst's
  last admitted request cannot push its first one past its deadline.
MARGIN covers what the measurement has not seen yet (GC, a busy event loop). A request without
a deadline is never refused; its cost is still spent from the slack of the others (it waits in
the queue, and the deadlines after it are decided behind it).
O(requests ahead x log seats) per decision, on the event loop: a few ms for a burst of 400.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.step_model import decode_seconds, prefill_row_seconds
from protocol import messages as m

MARGIN = 1.5  # the estimate times this must fit: steps under load run slower than measured quiet
# (on 2 cores the gateway busy with a burst took a core from the worker: 32-row steps 1.4x the
# probe's), and wander (GC)
CHUNK_ROWS = 16  # prompt rows a shared step carries, for the cost of one


@dataclass(eq=False)
class Work:
    """One admitted request as admission counts it."""

    model: str  # the model id; "" when the name was not found (the route answers 404)
    prompt_tokens: int  # its characters until tokenized (an upper bound), then its tokens
    max_tokens: int
    n: int = 1
    deadline: float | None = None  # monotonic; None: none
    # Tokens its longest choice has had so far: set when it runs (Generation.longest_choice).
    generated: Callable[[], int] | None = None
    # Set by Backlog.commit: seconds it could still lose when admitted, what the backlog had
    # spent by then, and what it costs those admitted before it.
    slack: float | None = None
    spent_at: float = 0.0
    cost: float = field(default=0.0)

    def remaining(self) -> tuple[int, int]:
        """(prompt rows still to compute, decode steps still to run)."""
        done = self.generated() if self.generated is not None else 0
        return (0 if done else self.prompt_tokens), max(0, self.max_tokens - done)


@dataclass(frozen=True)
class Capacity:
    """What serves a model now: its workers' measured costs (the slowest worker's, to be safe)
    and how many sequences they run at once."""

    costs: m.StepCosts
    seats: int  # sequences its ready workers run at once, summed
    workers: int

    def row_s(self) -> float:
        """Seconds of one prompt row, spread over the workers."""
        per_row = prefill_row_seconds(self.costs.prefill_row_s, CHUNK_ROWS)
        assert per_row is not None  # a Capacity is built only with measured costs
        return per_row / max(1, self.workers)

    def step_s(self, decoding: int) -> float:
        """Seconds of a decode step with `decoding` sequences spread over the workers."""
        per_worker = min(max(1, self.seats // max(1, self.workers)),
                         math.ceil(max(1, decoding) / max(1, self.workers)))
        step = decode_seconds(self.costs.decode_s, per_worker)
        assert step is not None
        return step


@dataclass(frozen=True)
class Decision:
    finish_s: float  # seconds from now to its last token, margin included
    cost_s: float  # seconds it adds to each request admitted before it, margin included
    short_by: float  # > 0: the most any admitted deadline would be missed by, were it admitted


class Backlog:
    def __init__(self, capacity: Callable[[str], Capacity | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._capacity = capacity
        self._clock = clock
        self._works: dict[Work, None] = {}  # admission order
        self.spent = 0.0  # seconds every admission so far added to those before it

    def __len__(self) -> int:
        return len(self._works)

    def add(self, work: Work) -> None:
        self._works[work] = None

    def remove(self, work: Work) -> None:
        self._works.pop(work, None)

    def ahead_of(self, work: Work) -> list[Work]:
        """The same model's work admitted before `work` (all of it, if `work` is not in)."""
        out = []
        for other in self._works:
            if other is work:
                break
            if other.model == work.model:
                out.append(other)
        return out

    def decide(self, work: Work) -> Decision | None:
        """When `work` would finish behind what was admitted before it, and what it would cost
        their deadlines; None while no worker of its model has reported its costs."""
        cap = self._capacity(work.model) if work.model else None
        if cap is None:
            return None
        ahead = self.ahead_of(work)
        prompt_rows = work.prompt_tokens + sum(w.remaining()[0] for w in ahead)
        free = [0] * max(1, cap.seats)  # the decode step at which each seat frees
        for other in ahead:
            left = other.remaining()[1]
            for _ in range(other.n):
                heapq.heappush(free, heapq.heappop(free) + left)
        start = max(heapq.nsmallest(work.n, free))
        decoding = sum(w.n for w in ahead) + work.n
        finish = prompt_rows * cap.row_s() + (start + work.max_tokens) * cap.step_s(decoding)
        # Beside the requests ahead: its prompt in their steps, its rows in each of their steps.
        extra_row = cap.step_s(decoding) - cap.step_s(decoding - work.n)
        cost = work.prompt_tokens * cap.row_s() + work.max_tokens * extra_row
        # What it would spend beyond what it has spent already (deciding again after tokenizing).
        more = MARGIN * cost - work.cost
        short = max((self.spent - w.spent_at + more - w.slack for w in ahead
                     if w.slack is not None), default=0.0)
        return Decision(MARGIN * finish, MARGIN * cost, short)

    def commit(self, work: Work, decision: Decision | None) -> None:
        """`work` is admitted as decided: its cost is spent from those before it, its slack
        kept for those after it (deciding again, after tokenizing, replaces the first)."""
        if decision is None:
            return
        # Deciding again keeps what later admissions already spent of its slack.
        consumed = self.spent - work.spent_at if work.slack is not None else 0.0
        self.spent += decision.cost_s - work.cost
        work.cost = decision.cost_s
        work.spent_at = self.spent - consumed
        if work.deadline is not None:
            work.slack = work.deadline - (self._clock() + decision.finish_s)

    def idle_s(self, work: Work) -> float | None:
        """The least `work` could take: alone on an idle worker, no margin (a refusal on this
        figure is certain: 400, not worth retrying)."""
        cap = self._capacity(work.model) if work.model else None
        if cap is None:
            return None
        per_row = min(s for _, s in cap.costs.prefill_row_s) / max(1, cap.workers)
        return work.prompt_tokens * per_row + work.max_tokens * cap.step_s(work.n)


def capacity_of(workers: list[tuple[m.StepCosts | None, int]]) -> Capacity | None:
    """A model's Capacity from its ready workers' (costs, max_num_seqs); None if none reported.
    The slowest worker's costs stand for all: an estimate that must not run short."""
    measured = [(c, s) for c, s in workers if c is not None and c.decode_s and c.prefill_row_s]
    if not measured:
        return None
    slowest = max(measured, key=lambda cs: decode_seconds(cs[0].decode_s, 1) or 0.0)[0]
    return Capacity(slowest, sum(s for _, s in workers), len(workers))
