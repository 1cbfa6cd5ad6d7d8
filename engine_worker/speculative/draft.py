"""A draft model as a speculative proposer, run in the same worker on its own small KV cache.

Data flow, per step, for the sequences the engine wants drafts for:

    sync: drop the draft cache's positions whose tokens were rejected drafts (a rollback is just
          a smaller `num_computed`; the rows are overwritten later, as in the target's cache)
    catch up: one batched pass feeding each sequence's tokens the draft has not seen yet (the
          whole prompt the first time, in chunks of CHUNK tokens before that pass, then the last
          one or two committed tokens); its last logits give draft 1
    then k - 1 batched one-token passes, feeding draft j to get draft j + 1

Each draft is drawn from the draft's fully processed distribution for that request (the same
penalties, temperature, top-k/top-p as the target), with the sequence's own generator, and that
distribution q travels with the draft to the acceptance step; a greedy request drafts the argmax.
The draft must share the target's tokenizer (same vocabulary size, checked at start).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_worker.block_manager import BlockManager
from engine_worker.model_runner import ModelRunner
from engine_worker.sampler import Sampler, is_greedy
from engine_worker.sequence import Sequence
from engine_worker.step import SamplerInput, StepItem

CHUNK = 512  # the draft's prefill chunk (tokens a pass), as the target's scheduler chunks


@dataclass
class _DraftState:
    """The draft cache of one sequence: positions [0, num_computed) hold the K/V of its
    committed tokens, then of the drafts `tail` fed from position `tail_start` on."""

    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    tail_start: int = 0
    tail: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler()
        # The draft cache's blocks: the target's allocator, with no prefix cache (a draft's
        # positions past its committed tokens are rewritten at will).
        self.blocks = BlockManager(runner.num_blocks, runner.block_size,
                                   enable_prefix_caching=False)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def release(self, seq: Sequence) -> None:
        state = seq.spec.proposer
        if isinstance(state, _DraftState):
            self.blocks.release(state.block_table)
        seq.spec.proposer = None

    def propose(self, seqs: list[Sequence], limits: list[int]
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        ks = [self._prepare(seq, k) for seq, k in zip(seqs, limits, strict=True)]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        for i in live:  # a long catch-up (the prompt, the first time): in chunks first
            self._catch_up(seqs[i])
        if live:
            items = []
            for i in live:
                seq, st = seqs[i], seqs[i].spec.proposer
                items.append(StepItem(seq.token_ids[st.num_computed :], st.num_computed,
                                      st.block_table))
            self._draw(seqs, live, self.runner.execute(items), drafts, probs)
        for j in range(1, max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if k > j]
            items = [StepItem([drafts[i][j - 1]], seqs[i].num_tokens + j - 1,
                              seqs[i].spec.proposer.block_table) for i in live]
            self._draw(seqs, live, self.runner.execute(items), drafts, probs)
        out: list[tuple[list[int], torch.Tensor | None]] = []
        for i, seq in enumerate(seqs):
            st = seq.spec.proposer
            if ks[i] > 0:
                # Fed: every committed token, then drafts 1..k-1 (draft k was never fed).
                st.tail_start = seq.num_tokens
                st.tail = drafts[i][:-1]
                st.num_computed = seq.num_tokens + ks[i] - 1
            out.append((drafts[i], torch.stack(probs[i]) if probs[i] else None))
        return out

    def _catch_up(self, seq: Sequence) -> None:
        """Feed all but the last CHUNK unseen tokens of `seq` in chunks of CHUNK (chunked
        prefill: a long prompt never becomes one pass of its whole length)."""
        st = seq.spec.proposer
        while seq.num_tokens - st.num_computed > CHUNK:
            chunk = seq.token_ids[st.num_computed : st.num_computed + CHUNK]
            self.runner.execute([StepItem(chunk, st.num_computed, st.block_table)])
            st.num_computed += CHUNK

    def _prepare(self, seq: Sequence, k: int) -> int:
        """Roll `seq`'s draft cache back to its committed tokens and give it blocks for k
        drafts; returns how many drafts it can have (0 when the draft cache is full)."""
        st = seq.spec.proposer
        if not isinstance(st, _DraftState):
            st = seq.spec.proposer = _DraftState()
        tokens = seq.token_ids
        keep = st.tail_start
        for j, d in enumerate(st.tail):
            if st.tail_start + j < len(tokens) and tokens[st.tail_start + j] == d:
                keep += 1
            else:
                break
        st.num_computed = min(st.num_computed, keep)
        st.tail = []
        # The last committed token is always fed again, as the target does.
        st.num_computed = min(st.num_computed, seq.num_tokens - 1)
        k = min(k, self.runner.max_model_len - seq.num_tokens + 1)
        if k <= 0:
            return 0
        if not self.blocks.extend(st.block_table, seq.num_tokens + k - 1):
            return 0
        return k

    def _draw(self, seqs: list[Sequence], live: list[int], logits: torch.Tensor,
              drafts: list[list[int]], probs: list[list[torch.Tensor]]) -> None:
        """Draw the next draft of each live sequence from its processed draft distribution."""
        inputs = [SamplerInput(seqs[i].params, seqs[i].output_token_ids + drafts[i],
                               seqs[i].generator, seqs[i].prompt_token_ids) for i in live]
        q = self.sampler.probs(logits, inputs)  # (L, V)
        for r, i in enumerate(live):
            seq = seqs[i]
            if is_greedy(seq.params):
                tok = int(q[r].argmax())
            else:
                cdf = q[r].double().cumsum(0)  # (V,)
                u = torch.rand((), generator=seq.generator, dtype=torch.float64,
                               device=q.device)
                tok = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_max(
                    q.shape[1] - 1))
            drafts[i].append(tok)
            probs[i].append(q[r])
