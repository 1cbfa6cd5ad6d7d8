"""The speculation state of one sequence, kept on it as `seq.spec` (no torch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A target decode step's seconds by its rows, as the engine measures them (StepCosts.decode_s;
# None before any measurement): what a draft's price is weighed against (draft.py).
StepSeconds = Callable[[int], float | None] | None


@dataclass
class SpecState:
    """What speculation remembers about one sequence between steps.

    `proposer` is the proposer's own (an n-gram index, a draft model's KV blocks), freed by its
    `release`. The running acceptance rate turns speculation off a while for a sequence whose
    drafts keep failing (engine_worker/speculative/decoder.py)."""

    proposer: Any = None
    acceptance: float = 1.0  # running mean of the fraction of drafts accepted
    skip_steps: int = 0  # steps left to decode plainly before probing again
    backoffs: int = 0  # failed probes in a row: the next backoff is 2**this longer
