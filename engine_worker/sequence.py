"""One generation stream (`Sequence`) and the n choices of one request (`SequenceGroup`).

Data flow: the engine turns a `Generate` message into a `SequenceGroup` of `params.n` sequences
and hands each to the scheduler. The block manager fills in `block_table`, `num_computed_tokens`
and `num_cached_tokens`; the scheduler advances `num_computed_tokens` after each step, appends
sampled tokens, and sets `status` / `finish_reason`. The engine reads the new tokens back.

No torch here: this is plain bookkeeping, tested with small fakes.
"""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import Any

from engine_worker.speculative.state import SpecState
from protocol.messages import SamplingParams

# Process-wide source of sequence ids. `next()` on an itertools.count is atomic under the GIL,
# and the counter is never reset, so ids stay unique for the life of the process.
_SEQ_IDS = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()  # in the scheduler's waiting queue; owns no blocks
    RUNNING = auto()  # in the running batch; owns blocks for all of its tokens
    FINISHED = auto()  # done (stop, length, abort, timeout); owns no blocks


class Sequence:
    """The tokens and cache bookkeeping of one choice of one request.

    Invariants while RUNNING: `len(block_table) * block_size >= num_tokens` and
    `num_cached_tokens <= num_computed_tokens < num_tokens` (the newest token is never computed
    yet: computing it is what yields the logits for the next one).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        group: SequenceGroup | None = None,
    ) -> None:
        self.seq_id: int = next(_SEQ_IDS)
        self.request_id = request_id
        self.index = index
        self.params = params
        self.group = group
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # prompt + outputs, kept in step with the two lists above so reads are O(1).
        self._token_ids: list[int] = list(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        # Paged KV bookkeeping, owned by the BlockManager.
        self.block_table: list[int] = []
        # Hash-chain value of each full, computed block, in table order (see block_manager).
        self.block_hashes: list[bytes] = []
        self.cache_salt = b""  # the prefix cache's tenant (Generate.cache_salt): its own chains
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # from the prefix cache at the first allocation (for the API)
        self.num_allocations = 0  # > 1 after a preemption and re-admission
        self.num_preemptions = 0
        # Prompt tokens whose K/V this sequence computed itself (not served from the prefix
        # cache), summed over all its prefills: a preempted sequence that recomputes counts again.
        self.num_prefilled_tokens_total = 0
        # Per-request state that lives as long as the sequence (no side maps in the worker):
        # when the scheduler first admitted it (monotonic seconds; the queue-wait metric).
        self.first_scheduled_time: float | None = None
        # Its private sampling RNG (a torch.Generator, set by the engine; no torch here).
        self.generator: Any = None
        # Speculative decoding: the proposer's own state and the acceptance bookkeeping that
        # pauses speculation for a sequence whose drafts keep failing.
        self.spec = SpecState()

    # -- token views ---------------------------------------------------------------------------

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output tokens. The internal list: read it, do not mutate it."""
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, index={self.index}, "
            f"status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


class SequenceGroup:
    """The `params.n` choices of one request, sharing one prompt.

    The first sequence (the leader) is prefilled alone; the scheduler admits its siblings only
    once `prompt_computed` is set, so they find the prompt's full blocks in the prefix cache
    and compute only the tail.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        if params.n < 1:
            raise ValueError(f"n must be >= 1, got {params.n}")
        self.request_id = request_id
        # Set once and never cleared: a preempted leader does not re-gate its siblings.
        self.prompt_computed = False
        self.seqs: list[Sequence] = [
            Sequence(request_id, prompt_token_ids, params, index=i, group=self)
            for i in range(params.n)
        ]

    @property
    def leader(self) -> Sequence:
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)
