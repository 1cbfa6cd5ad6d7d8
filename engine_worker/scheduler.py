"""Continuous-batching scheduler with chunked prefill and preemption. No torch.

Data flow, once per engine step:

    chunks = scheduler.schedule(k)           # which tokens of which sequences to compute now
    emitted = ...                            # the engine executes, then samples or accepts:
                                             # per chunk its token(s), None if not sampling
    new = scheduler.update(chunks, emitted)  # advance, append, finish, free: who got tokens

A sequence is WAITING (queue, no blocks) or RUNNING (batch, blocks for all its tokens). Each step
spends a budget of `max_num_batched_tokens`: first one token for every decoding sequence (plus up
to `lookahead` draft slots each when the engine speculates), then the next chunk of every running
prefill, then new admissions in FCFS order. The prompt rows (the last two) are further held to
`prefill_rows(decode rows, first prompt's length)`: what the step's measured time allows
(engine_worker.step_costs), so that decoders are never stalled by a chunk sized in tokens on
another host or model, nor a long prompt spread thinner than step_costs.PROMPT_SPREAD steps.

Speculation: a decode chunk may carry drafts (`chunk.draft_token_ids`, filled by the engine's
proposer after scheduling); `update` then receives every token the acceptance step emitted. Only
committed tokens advance `num_computed_tokens`: the K/V of accepted drafts is kept, that of
rejected ones sits past `num_computed_tokens` and is overwritten later, and the block manager
hashes only full blocks below `num_computed_tokens` into the prefix cache. When a decode finds
no free block, the newest running sequence is preempted (blocks freed, back to the front of the
queue, recomputed later, mostly from the prefix cache): a sequence is delayed, never dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from engine_worker.block_manager import BlockManager
from engine_worker.sequence import Sequence, SequenceGroup, SequenceStatus
from engine_worker.step import ScheduledChunk
from protocol.messages import SamplingParams


class RequestTooLarge(ValueError):
    """A request that could never be served by this worker, whatever the load."""


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int],
        prefill_rows: Callable[[int, int], int] | None = None,
    ) -> None:
        if max_num_seqs <= 0 or max_model_len <= 0:
            raise ValueError("max_num_seqs and max_model_len must be positive")
        # Every running sequence may be decoding at once; each needs one token of the budget,
        # else the newest decoders would starve behind the oldest.
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({max_num_seqs})"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # Prompt rows a step with that many decode rows may carry (engine_worker.step_costs:
        # sized by measured time); None: the token budget alone.
        self.prefill_rows = prefill_rows
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # admission order: oldest first, newest last
        self._by_request: dict[str, list[Sequence]] = {}  # live (unfinished) sequences
        self.preemptions = 0

    # -- figures -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def get(self, request_id: str) -> list[Sequence]:
        """The unfinished sequences of a request ([] if none)."""
        return list(self._by_request.get(request_id, ()))

    # -- requests in and out -------------------------------------------------------------------

    @staticmethod
    def make_group(request_id: str, prompt: list[int], params: SamplingParams) -> list[Sequence]:
        """The `params.n` sequences of one request, grouped so siblings share the prompt."""
        return SequenceGroup(request_id, prompt, params).seqs

    def add(self, seq: Sequence) -> None:
        prompt_len, max_tokens = seq.num_prompt_tokens, seq.params.max_tokens
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if prompt_len + max_tokens > self.max_model_len:
            raise RequestTooLarge(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context length of {self.max_model_len} tokens"
            )
        # The last sampled token is never fed back, so the cache holds at most this many.
        peak = self.block_manager.blocks_needed(prompt_len + max_tokens - 1)
        if peak > self.block_manager.num_blocks:
            raise RequestTooLarge(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {peak} KV "
                f"blocks; this worker's cache has {self.block_manager.num_blocks} in all"
            )
        seq.status = SequenceStatus.WAITING
        self._waiting.append(seq)
        self._by_request.setdefault(seq.request_id, []).append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every live sequence of a request with reason "abort"; returns them."""
        seqs = self.get(request_id)
        for seq in seqs:
            self._finish(seq, "abort")
        return seqs

    def abort_seq(self, request_id: str, index: int) -> Sequence | None:
        """Finish one live choice of a request with reason "abort" (its siblings go on);
        returns it, or None if it is not live."""
        seq = next((s for s in self._by_request.get(request_id, ()) if s.index == index), None)
        if seq is None:
            return None
        if seq.group is not None and seq is seq.group.leader and not seq.group.prompt_computed:
            # Its siblings wait for the leader's prompt: ending it first would strand them.
            return None
        self._finish(seq, "abort")
        return seq

    # -- the step ------------------------------------------------------------------------------

    def draft_room(self, seq: Sequence) -> int:
        """Most drafts `seq` may carry: every accepted draft plus the bonus token must fit in
        max_tokens and the context."""
        return max(0, min(seq.params.max_tokens - seq.num_output_tokens,
                          self.max_model_len - seq.num_tokens) - 1)

    def _first_prompt_rows(self) -> int:
        """The length of the prompt first in line: the oldest running prefill's whole prompt
        (not what is left of it, so that its allowance does not shrink with every chunk and
        the prompt is done in about PROMPT_SPREAD steps), else the head of the queue's."""
        for seq in self._running:
            if seq.num_tokens - seq.num_computed_tokens > 1:
                return seq.num_prompt_tokens
        return self._waiting[0].num_tokens if self._waiting else 0

    def schedule(self, lookahead: int = 0) -> list[ScheduledChunk]:
        """This step's chunks; decodes get up to `lookahead` draft slots each (blocks reserved)."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False

        # 1. Decodes: one token each, oldest first. Victims are taken from the tail of
        # `_running`, so a sequence already given a chunk this step is never preempted.
        for seq in list(self._running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_tokens - seq.num_computed_tokens != 1:
                continue  # still prefilling: step 2
            # Drafts only where their blocks are free now: speculation never preempts anyone.
            drafts = min(lookahead, self.draft_room(seq)) if seq.params.speculative else 0
            if drafts and not self.block_manager.can_append(seq, drafts):
                drafts = 0
            while not self.block_manager.can_append(seq):
                victim = self._running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.append_slot(seq, drafts)
            chunks.append(ScheduledChunk(seq, seq.num_tokens - 1, 1, sample=True,
                                         max_drafts=drafts))
            budget -= 1 + drafts
        if self.prefill_rows is not None:
            decode_rows = self.max_num_batched_tokens - budget
            budget = min(budget, self.prefill_rows(decode_rows, self._first_prompt_rows()))

        # 2. Running prefills: their blocks were all allocated at admission.
        for seq in self._running:
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining <= 1 or budget <= 0:
                continue
            chunks.append(self._chunk(seq, budget))
            budget -= chunks[-1].num_tokens

        # 3. Admissions, strictly FCFS: the head of the queue that cannot go blocks the rest.
        # Not in a step that preempted: blocks are short, and the victim would bounce back.
        # Siblings waiting for their leader's prompt are set aside (they keep their place at
        # the head): they wait for the leader, not for memory, so they must not hold up the
        # requests behind them.
        gated: list[Sequence] = []
        while (
            not preempted
            and self._waiting
            and budget > 0
            and len(self._running) < self.max_num_seqs
        ):
            seq = self._waiting[0]
            group = seq.group
            if group is not None and seq is not group.leader and not group.prompt_computed:
                gated.append(self._waiting.popleft())  # its leader's blocks are not cached yet
                continue
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            self._waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            chunks.append(self._chunk(seq, budget))
            budget -= chunks[-1].num_tokens
        self._waiting.extendleft(reversed(gated))
        return chunks

    def update(
        self, chunks: list[ScheduledChunk], sampled: list[int | list[int] | None]
    ) -> list[Sequence]:
        """Apply one step's results: per chunk, its sampled token, or the tokens acceptance
        emitted (accepted drafts, then one sampled token), or None for a prefill chunk that does
        not sample. Tokens past a finishing one are dropped (`chunk.num_emitted` says how many
        were kept). Returns the sequences that got new tokens, in chunk order."""
        if len(chunks) != len(sampled):
            raise ValueError(f"{len(chunks)} chunks but {len(sampled)} sampled entries")
        new: list[Sequence] = []
        for chunk, token in zip(chunks, sampled, strict=True):
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted since it was scheduled; its blocks are already freed
            if chunk.start_pos != seq.num_computed_tokens:
                raise RuntimeError(f"stale chunk at {chunk.start_pos} for {seq!r}")
            end = chunk.start_pos + chunk.num_tokens
            seq.num_prefilled_tokens_total += max(
                0, min(end, seq.num_prompt_tokens) - chunk.start_pos
            )
            tokens = [token] if isinstance(token, int) else list(token or [])
            if chunk.sample and not tokens:
                raise ValueError(f"no token sampled for a sampling chunk of {seq!r}")
            if len(tokens) > 1 + len(chunk.draft_token_ids) or (
                tokens[:-1] != chunk.draft_token_ids[: len(tokens) - 1]
            ):
                raise ValueError(f"emitted tokens are not accepted drafts + one for {seq!r}")
            # Accepted drafts were fed this step, so their K/V is computed too.
            seq.num_computed_tokens = end + max(0, len(tokens) - 1)
            if seq.group is not None and end >= seq.num_prompt_tokens:
                seq.group.prompt_computed = True
            if not chunk.sample:
                self.block_manager.mark_computed(seq)
                continue
            chunk.num_emitted = 0
            reason = None
            for tok in tokens:
                seq.append_token(tok)
                chunk.num_emitted += 1
                reason = self._finish_reason(seq, tok)
                if reason is not None:
                    break
            # Tokens dropped after a finish were never committed.
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            self.block_manager.mark_computed(seq)
            new.append(seq)
            if reason is not None:
                self._finish(seq, reason)
        return new

    # -- internals -----------------------------------------------------------------------------

    def _chunk(self, seq: Sequence, budget: int) -> ScheduledChunk:
        remaining = seq.num_tokens - seq.num_computed_tokens
        n = min(remaining, budget)
        if self.prefill_rows is not None and remaining <= self.block_manager.block_size:
            # A prompt's last block goes whole, however small the step's share: a warm run (the
            # rest of the prompt past its cached blocks) is then computed in one chunk alone or
            # among others, and gives the same numbers (tests/e2e/test_batch_invariance.py).
            n = remaining
        return ScheduledChunk(seq, seq.num_computed_tokens, n, sample=n == remaining)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids:
            return "stop"
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End a live sequence: out of the batch (its blocks freed) or the queue, forgotten."""
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            self.block_manager.free(seq)
        else:
            self._waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        live = self._by_request.get(seq.request_id)
        if live is not None:
            live.remove(seq)
            if not live:
                del self._by_request[seq.request_id]

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and requeue it at the front; it is recomputed on re-admission."""
        self._running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._waiting.appendleft(seq)
        self.preemptions += 1
