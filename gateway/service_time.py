"""How long one request will hold a worker: the estimate admission checks each request against.

    a request ends at a worker ──observe(worker, batch, prompt_tokens, prefill_s, tpot_s)──▶
        per worker: seconds per prompt token (EWMA) and seconds per decode step for each batch
        size bucket (1, 2, 4, ... 64+; EWMA each)
    admission asks estimate(workers, prompt_tokens, max_tokens, batch) ──▶ seconds on the
        fastest of those workers with `batch` sequences running, or None before any measurement

A request's own service time is its prefill (prompt tokens x the measured seconds per token, at
least what short prompts took) plus its decode (max_tokens steps x the measured step time at the
batch it will run in). Step time is measured per batch size because it is not constant: on a
host whose throughput falls with concurrency (a bfloat16 path with no hardware behind it), 16
rows cost 10x one row a step.
A batch size with no measurement of its own borrows the nearest measured bucket: one above as it
is (a larger batch is no faster), one below scaled by sqrt(batch / that bucket), between the
perfect batching of a GPU (x1) and none at all (x batch); the bucket's own figure replaces that
guess once requests run there. Everything is O(buckets) per call and bounded per worker.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ALPHA = 0.3  # EWMA weight of the newest observation: a few requests move the estimate
# Prompts shorter than this teach only a prefill's fixed cost, not a rate per token: a forward's
# overhead dominates them, and taken per token it made a near-full context look like 30 s.
SHORT_PROMPT = 64


def bucket(batch: int) -> int:
    """The bucket a batch of `batch` sequences is counted in (the largest edge <= batch)."""
    return max(b for b in BUCKETS if b <= max(1, batch))


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else ALPHA * new + (1 - ALPHA) * old


@dataclass
class WorkerRates:
    prefill_fixed_s: float | None = None  # seconds a short prefill takes: mostly fixed cost
    prefill_s: float | None = None  # seconds per prompt token, from prompts of SHORT_PROMPT+
    step_s: dict[int, float] = field(default_factory=dict)  # bucket -> seconds per decode step

    def prefill(self, prompt_tokens: int) -> float:
        """Seconds to prefill `prompt_tokens`; what was measured of short prompts is a floor,
        never a rate (a 3-token prefill of 30 ms is one forward's cost, not 10 ms a token)."""
        if prompt_tokens <= 0:
            return 0.0
        fixed = self.prefill_fixed_s or 0.0
        if self.prefill_s is None:
            return fixed
        return max(fixed, self.prefill_s * prompt_tokens)

    def step(self, batch: int, lower_bound: bool = False) -> float | None:
        """Seconds per decode step with `batch` sequences running; None: nothing measured.
        `lower_bound`: the least it could be, for a refusal that must be certain: a bucket
        borrowed from above is then scaled down as if batching were perfect (a batch of k costs
        at most k times one row's step), not taken as it is."""
        if not self.step_s:
            return None
        b = bucket(batch)
        if b in self.step_s:
            return self.step_s[b]
        above = [k for k in self.step_s if k > b]
        if above:
            k = min(above)
            return self.step_s[k] * (b / k if lower_bound else 1.0)
        below = max(self.step_s)
        return self.step_s[below] * math.sqrt(max(1, batch) / below)


class ServiceTimes:
    def __init__(self) -> None:
        self._workers: dict[str, WorkerRates] = {}

    def observe(self, worker: str, batch: int, prompt_tokens: int, prefill_s: float | None,
                tpot_s: float | None) -> None:
        """A request ended at `worker`, which ran about `batch` sequences meanwhile: its prefill
        of `prompt_tokens` took `prefill_s` (worker-side, first scheduled to first token) and its
        later tokens came every `tpot_s` on average (None: not measured)."""
        rates = self._workers.setdefault(worker, WorkerRates())
        if prefill_s is not None and 0 < prompt_tokens < SHORT_PROMPT and prefill_s >= 0:
            rates.prefill_fixed_s = _ewma(rates.prefill_fixed_s, prefill_s)
        elif prefill_s is not None and prompt_tokens > 0 and prefill_s >= 0:
            rates.prefill_s = _ewma(rates.prefill_s, prefill_s / prompt_tokens)
        if tpot_s is not None and tpot_s > 0:
            b = bucket(batch)
            rates.step_s[b] = _ewma(rates.step_s.get(b), tpot_s)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the workers not in `keep` (they left)."""
        ready = set(keep)
        for gone in [w for w in self._workers if w not in ready]:
            del self._workers[gone]

    def rates(self, worker: str) -> WorkerRates | None:
        return self._workers.get(worker)

    def estimate(self, workers: Iterable[tuple[str, int]], prompt_tokens: int, max_tokens: int,
                 extra: int = 1, lower_bound: bool = False) -> float | None:
        """Seconds a request would hold the fastest of `workers` ((id, sequences running now)
        pairs), joining with `extra` sequences of its own; None when no worker is measured."""
        best: float | None = None
        for worker, running in workers:
            rates = self._workers.get(worker)
            step = rates.step(running + extra, lower_bound) if rates else None
            if rates is None or step is None:
                continue
            seconds = rates.prefill(prompt_tokens) + step * max_tokens
            best = seconds if best is None else min(best, seconds)
        return best

    def tokens_within(self, workers: Iterable[tuple[str, int]], prompt_tokens: int,
                      seconds: float, extra: int = 1) -> int | None:
        """How many tokens the fastest of `workers` could decode for a new request within
        `seconds` (after its prefill); None when no worker is measured."""
        per_token = self.estimate(workers, 0, 1, extra)
        prefill = self.estimate(workers, prompt_tokens, 0, extra)
        if per_token is None or prefill is None or per_token <= 0:
            return None
        return max(0, math.floor((seconds - prefill) / per_token))


class DoesNotFit(Exception):
    """A request that cannot finish before its deadline. `idle`: not even on an idle worker
    (answer 400 naming max_tokens or timeout); otherwise not at today's load (429, retry after
    `retry_after` seconds)."""

    def __init__(self, message: str, idle: bool, retry_after: float = 1.0,
                 param: str = "max_tokens") -> None:
        super().__init__(message)
        self.idle = idle
        self.retry_after = retry_after
        self.param = param


def check_fit(times: ServiceTimes, workers: list[tuple[str, int]], prompt_tokens: int,
              max_tokens: int, n: int, budget_s: float, remaining_s: float,
              wait_s: float) -> None:
    """DoesNotFit unless `max_tokens` (with `n` choices) can finish within the request's
    deadline: `budget_s` from its arrival, `remaining_s` from now, after `wait_s` in the queue.
    Beyond a deadline already passed, says nothing (admits) while no worker is measured."""
    if remaining_s <= 0:
        raise DoesNotFit(f"the request's deadline ({budget_s:.3g} s) passed before it could be "
                         "sent to a worker: raise timeout", idle=True, param="timeout")
    # A refusal rests on the least the request could take, never on a figure borrowed from a
    # busier batch: "not even on an idle worker" is a 400 the client must not retry, and a 429
    # for a batch size never measured would keep it from ever being measured.
    idle_workers = [(w, 0) for w, _ in workers]
    idle = times.estimate(idle_workers, prompt_tokens, max_tokens, n, lower_bound=True)
    if idle is None:
        return
    if idle > budget_s:
        per_token = times.estimate(idle_workers, 0, 1, n, lower_bound=True) or 0.0
        raise DoesNotFit(
            f"max_tokens={max_tokens} cannot finish within this request's deadline of "
            f"{budget_s:.1f} s even on an idle worker (about {idle:.1f} s at the "
            f"{per_token * 1000:.0f} ms a token measured): lower max_tokens or raise timeout",
            idle=True)
    busy = times.estimate(workers, prompt_tokens, max_tokens, n, lower_bound=True)
    if busy is not None and wait_s + busy > remaining_s:
        raise DoesNotFit(
            f"at the current load a request of max_tokens={max_tokens} would take about "
            f"{wait_s + busy:.1f} s, past its deadline ({remaining_s:.1f} s left)",
            idle=False, retry_after=max(1.0, wait_s + busy - remaining_s))
