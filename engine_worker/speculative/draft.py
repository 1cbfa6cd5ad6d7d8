"""A draft model as a speculative proposer, run in the same worker on its own small KV cache.

Data flow, per step, for the sequences the engine wants drafts for:

    sync: drop the draft cache's positions whose tokens were rejected drafts (a rollback is just
          a smaller `num_computed`; the rows are overwritten later, as in the target's cache)
    catch up: one batched pass feeding each sequence's tokens the draft has not seen yet (the
          whole prompt the first time, in chunks of CHUNK tokens before that pass, then the last
          one or two committed tokens); its last logits give draft 1
    then up to k - 1 batched one-token passes, feeding draft j to get draft j + 1; a sequence
          stops where the odds of its next draft fall below what a draft costs (`threshold`:
          its pass and one more verified row, in target steps, measured), so a guess the draft
          model doubts is not followed by more guesses that would be thrown away with it

Each draft is drawn from the draft's fully processed distribution for that request (the same
penalties, temperature, top-k/top-p as the target), with the sequence's own generator, and that
distribution q travels with the draft to the acceptance step; a greedy request drafts the argmax
(a plain greedy one, nothing adjusting its logits, of the raw logits with no q made: its
verification takes the argmax too).
The draft must share the target's tokenizer (same vocabulary size, checked at start).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_worker.block_manager import BlockManager
from engine_worker.model_runner import ModelRunner
from engine_worker.sampler import Sampler, argmax_rows, is_greedy, plain_greedy
from engine_worker.sequence import Sequence
from engine_worker.speculative.hot_vocab import HotHead
from engine_worker.speculative.state import StepSeconds
from engine_worker.step import SamplerInput, StepItem

CHUNK = 512  # the draft's prefill chunk (tokens a pass), as the target's scheduler chunks
PASS_EMA = 0.2  # weight of the newest one-token pass in the draft's measured pass time


@dataclass
class _DraftState:
    """The draft cache of one sequence: positions [0, num_computed) hold the K/V of its
    committed tokens, then of the drafts `tail` fed from position `tail_start` on."""

    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    tail_start: int = 0
    tail: list[int] = field(default_factory=list)
    scanned: int = 0  # of its committed tokens, those looked at for a cold id (hot_vocab.py)
    cold: bool = False  # one was found: this sequence drafts over the whole vocabulary


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None,
                 min_confidence: float | None = 0.0, hot: HotHead | None = None) -> None:
        """`min_confidence`: the odds below which a sequence stops drafting this round (0:
        always k drafts; None: the price of a draft, measured; see `threshold`). `hot`: the
        draft model's head limited to the vocabulary's ASCII-rich prefix (hot_vocab.py), taken
        by a pass whose sequences are all plain greedy with no cold id in their text."""
        self.runner = runner
        self.hot = hot
        self.sampler = sampler or Sampler()
        self.min_confidence = min_confidence
        self.pass_s: float | None = None  # the draft's one-token pass, seconds (EWMA)
        self._exp_buf = np.empty(0, np.float32)  # _confidence's work row
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

    def threshold(self, k: int, target_step_s: StepSeconds) -> float:
        """The odds a next draft must have to be drafted. After draft j, the odds that draft
        j + 1 lands are about P(drafts 1..j all accepted) x (draft j's probability), as the
        draft model gives them; a landed draft saves a target step, and drafting it costs a
        draft pass and one more verified row. So the price, in target steps: (the draft's pass
        + a verified row's share of a (k + 1)-row step) / a one-row step, all measured on this
        host (0 until they are: every draft is drafted)."""
        if self.min_confidence is not None:
            return self.min_confidence
        if self.pass_s is None or target_step_s is None or k < 1:
            return 0.0
        one, more = target_step_s(1), target_step_s(k + 1)
        if not one or more is None:
            return 0.0
        return (self.pass_s + max(0.0, more - one) / k) / one

    def propose(self, seqs: list[Sequence], limits: list[int], target_step_s: StepSeconds = None
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        ks = [self._prepare(seq, k) for seq, k in zip(seqs, limits, strict=True)]
        stop = self.threshold(max(ks, default=0), target_step_s)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        trust = [1.0] * len(seqs)
        live = [i for i, k in enumerate(ks) if k > 0]
        for i in live:  # a long catch-up (the prompt, the first time): in chunks first
            self._catch_up(seqs[i])
        if live:
            items = []
            for i in live:
                seq, st = seqs[i], seqs[i].spec.proposer
                items.append(StepItem(seq.token_ids[st.num_computed :], st.num_computed,
                                      st.block_table))
            self._heat(seqs, live)
            self._draw(seqs, live, self._execute(items), drafts, probs, ks, trust, stop)
        for j in range(1, max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if k > j]
            if not live:  # every sequence stopped at a doubted draft
                break
            items = [StepItem([drafts[i][j - 1]], seqs[i].num_tokens + j - 1,
                              seqs[i].spec.proposer.block_table) for i in live]
            self._heat(seqs, live)
            self._draw(seqs, live, self._execute(items), drafts, probs, ks, trust, stop)
        if self.hot is not None:
            self.hot.hot = False  # a catch-up chunk or another caller: the whole head
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

    def _heat(self, seqs: list[Sequence], live: list[int]) -> None:
        """The next pass takes the hot head when every live sequence may: plain greedy (no q
        over every id to make), and no cold id (hot_vocab.py) in its committed text."""
        if self.hot is None:
            return
        hot = True
        for i in live:
            seq, st = seqs[i], seqs[i].spec.proposer
            if not st.cold and st.scanned < seq.num_tokens:
                st.cold = self.hot.leaves(seq.token_ids[st.scanned :])
                st.scanned = seq.num_tokens
            hot = hot and not st.cold and plain_greedy(seq.params)
        self.hot.hot = hot

    def _execute(self, items: list[StepItem]) -> torch.Tensor:
        """The draft's pass over `items`; a one-sequence pass of one or two tokens (a round's
        first, the last committed tokens, or a draft) is timed into `pass_s`: every round has
        one, so the price stays measured even while rounds stop at their first draft."""
        t0 = time.perf_counter()
        logits = self.runner.execute(items)
        if len(items) == 1 and len(items[0].token_ids) <= 2:
            s = time.perf_counter() - t0
            self.pass_s = s if self.pass_s is None else (1 - PASS_EMA) * self.pass_s \
                + PASS_EMA * s
        return logits

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
              drafts: list[list[int]], probs: list[list[torch.Tensor]], ks: list[int],
              trust: list[float], stop: float) -> None:
        """Draw the next draft of each live sequence from its processed draft distribution;
        where the odds of the next one fall below `stop`, its drafts end (ks[i] = so far).
        A plain greedy sequence drafts the argmax of the raw logits and keeps no distribution
        (its verification takes the argmax too): building and stacking dense one-hot rows of
        the vocabulary took ~0.9 ms of a 12 ms draft pass of the 0.5B Qwen (151,936 ids)."""
        plain = {i for i in live if plain_greedy(seqs[i].params)}
        made = {i: m for m, i in enumerate(i for i in live if i not in plain)}  # q's row of i
        inputs = [SamplerInput(seqs[i].params, seqs[i].output_token_ids + drafts[i],
                               seqs[i].generator, seqs[i].prompt_token_ids) for i in made]
        q = self.sampler.probs(logits[[r for r, i in enumerate(live) if i in made]], inputs) \
            if made else None  # (len(made), V)
        rows = [r for r, i in enumerate(live) if i in plain]  # one argmax for the step's rows
        best: dict[int, int] = {}
        if rows:
            picked = argmax_rows(logits if len(rows) == len(live) else logits[rows])
            best = dict(zip(rows, picked.tolist(), strict=True))
        for r, i in enumerate(live):
            seq, qr = seqs[i], None
            if i in plain:
                tok = best[r]
            else:
                assert q is not None
                qr = q[made[i]]
                if is_greedy(seq.params):
                    tok = int(argmax_rows(qr[None])[0])
                else:
                    cdf = qr.double().cumsum(0)  # (V,)
                    u = torch.rand((), generator=seq.generator, dtype=torch.float64,
                                   device=q.device)
                    tok = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_max(
                        q.shape[1] - 1))
                probs[i].append(qr)
            drafts[i].append(tok)
            if stop > 0 and len(drafts[i]) < ks[i]:  # a round's last draft has no next to weigh
                conf = self._confidence(qr, logits[r], tok, seq)
                trust[i] *= conf  # P(drafts 1..j all accepted), as the draft model sees it
                if trust[i] * conf < stop:  # the next one's odds, taking this one's for it
                    ks[i] = len(drafts[i])

    def _confidence(self, q: torch.Tensor | None, logits: torch.Tensor, tok: int, seq: Sequence
                    ) -> float:
        """The draft model's probability of its draft: q's, or for a greedy request (q one-hot,
        or none made) its softmax at temperature 1, 1 / sum(exp(logits - logits[tok])), in
        numpy into a buffer kept for it: right after a draft pass of the 0.5B Qwen (151,936 ids)
        ~0.2 ms where torch's logsumexp took ~0.4 (Zen 4)."""
        if q is not None and not is_greedy(seq.params):
            return float(q[tok])
        if logits.device.type != "cpu":
            return float(torch.exp(logits[tok].float() - torch.logsumexp(logits.float(), -1)))
        row = logits.float().numpy()
        if self._exp_buf.shape != row.shape:
            self._exp_buf = np.empty(row.shape, np.float32)
        np.subtract(row, row[tok], out=self._exp_buf)
        with np.errstate(over="ignore"):  # an id far above tok's: inf, so its odds are 0
            np.exp(self._exp_buf, out=self._exp_buf)
        return float(1.0 / self._exp_buf.sum(dtype=np.float64))
