"""Speculative decoding inside the batched engine: propose -> (execute) -> accept.

    Engine.step:  k = spec.lookahead(...)            # 0: plain decoding this step
                  chunks = scheduler.schedule(k)     # decode chunks reserve k draft slots
                  spec.propose(chunks)               # fills chunk.draft_token_ids / draft_probs
                  logits = runner.execute(...)       # drafts scored at every position
                  tokens = spec.accept(...)          # rejection sampling, see acceptance.py
                  scheduler.update(chunks, tokens)   # commits accepted drafts + one token

Proposers sit behind `Proposer` (n-gram prompt lookup in ngram.py, a draft model in draft.py);
a sequence's speculation state, the proposer's part included, is one object on it (`seq.spec`).

When it switches itself off, so that it never makes a loaded server slower:
- for a step, when more than `max_batch` sequences decode (verifying costs a chunk of 1 + k tokens
  per sequence, which a busy batch pays in full) or when the step's token budget cannot hold the
  drafts;
- for a sequence, when its running acceptance rate drops below `min_acceptance`: it then skips
  `BACKOFF_STEPS` steps (doubling after each failed probe) and probes again;
- per request: `params.speculative = False`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine_worker.sampler import Sampler, argmax_rows, is_greedy, plain_greedy
from engine_worker.sequence import Sequence
from engine_worker.speculative.acceptance import accept
from engine_worker.speculative.state import StepSeconds
from engine_worker.step import SamplerInput, ScheduledChunk

BACKOFF_STEPS = 16  # steps a sequence with failing drafts decodes plainly before probing again
MAX_BACKOFF_STEPS = 256  # the backoff doubles at each failed probe, up to this
EMA = 0.3  # weight of the newest step in a sequence's running acceptance rate


class Proposer(Protocol):
    """Guesses the next tokens of sequences; q is the distribution each guess was drawn from."""

    def propose(self, seqs: list[Sequence], limits: list[int], target_step_s: StepSeconds = None
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Per sequence, at most `limits[i]` drafts and their (n, V) draft probabilities
        (None: one-hot, i.e. a deterministic guess). `target_step_s`: the target's measured
        decode step by rows, for a proposer that weighs what a draft costs."""
        ...

    def release(self, seq: Sequence) -> None:
        """Forget `seq` (finished or aborted): free whatever its state holds."""
        ...


@dataclass
class SpecStats:
    proposed: int = 0  # draft tokens proposed and verified (cumulative)
    accepted: int = 0  # of those, accepted (cumulative)
    verify_steps: int = 0  # sequence-steps that carried drafts (cumulative)


class SpecDecoder:
    def __init__(self, proposer: Proposer, num_tokens: int, *, max_batch: int,
                 min_acceptance: float) -> None:
        if num_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.proposer = proposer
        self.k = num_tokens
        self.max_batch = max_batch
        self.min_acceptance = min_acceptance
        self.stats = SpecStats()

    def lookahead(self, num_running: int, token_budget: int) -> int:
        """Draft slots per decoding sequence this step (0: plain decoding)."""
        if num_running == 0 or num_running > self.max_batch:
            return 0
        return max(0, min(self.k, token_budget // num_running - 1))

    def propose(self, chunks: list[ScheduledChunk], target_step_s: StepSeconds = None) -> None:
        todo = []
        for c in chunks:
            if c.max_drafts <= 0:
                continue
            if c.seq.spec.skip_steps > 0:
                c.seq.spec.skip_steps -= 1
                continue
            todo.append(c)
        if not todo:
            return
        proposals = self.proposer.propose([c.seq for c in todo], [c.max_drafts for c in todo],
                                          target_step_s)
        for c, (drafts, q) in zip(todo, proposals, strict=True):
            c.draft_token_ids = list(drafts[: c.max_drafts])
            c.draft_probs = None if q is None or not drafts else q[: len(c.draft_token_ids)]

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def accept(self, sampler: Sampler, chunks: list[ScheduledChunk], logits: torch.Tensor
               ) -> list[list[int]]:
        """Tokens each chunk emits; `logits` (sum(1 + n_i), V) holds the rows of every position
        of the chunks, in order. Advances each sampled sequence's generator by exactly
        n_i + 1 uniforms (none for greedy ones)."""
        # Greedy without penalties needs no distributions: a draft passes while it is the
        # argmax, and the argmax follows (one batched argmax over every row, no dense p).
        fast = [i for i, c in enumerate(chunks) if plain_greedy(c.seq.params)]
        out: list[list[int] | None] = [None] * len(chunks)
        if fast:
            starts, row = [], 0
            for c in chunks:
                starts.append(row)
                row += 1 + len(c.draft_token_ids)
            best = argmax_rows(logits).tolist()  # (rows,)
            for i in fast:
                c = chunks[i]
                target = best[starts[i] : starts[i] + 1 + len(c.draft_token_ids)]
                a = 0
                while a < len(c.draft_token_ids) and c.draft_token_ids[a] == target[a]:
                    a += 1
                out[i] = c.draft_token_ids[:a] + [target[a]]
                self._note(c.seq, len(c.draft_token_ids), a)
            if len(fast) == len(chunks):
                return [o for o in out if o is not None]
            keep = [i for i in range(len(chunks)) if out[i] is None]
            rows = [r for i in keep for r in range(starts[i], starts[i] + 1 +
                                                   len(chunks[i].draft_token_ids))]
            rest = self._accept_sampled(sampler, [chunks[i] for i in keep], logits[rows])
            for i, toks in zip(keep, rest, strict=True):
                out[i] = toks
            return [o for o in out if o is not None]
        return self._accept_sampled(sampler, chunks, logits)

    def _accept_sampled(self, sampler: Sampler, chunks: list[ScheduledChunk],
                        logits: torch.Tensor) -> list[list[int]]:
        n = len(chunks)
        width = max(len(c.draft_token_ids) for c in chunks)
        inputs: list[SamplerInput] = []
        for c in chunks:
            seq, drafts = c.seq, c.draft_token_ids
            for j in range(len(drafts) + 1):
                # Penalties at draft position j count the drafts before it as outputs.
                inputs.append(SamplerInput(seq.params, seq.output_token_ids + drafts[:j],
                                           seq.generator, seq.prompt_token_ids))
        flat = sampler.probs(logits, inputs)  # (sum(1 + n_i), V)
        vocab = flat.shape[1]
        p = flat.new_zeros(n, width + 1, vocab)  # (N, K + 1, V)
        q = None
        if any(c.draft_probs is not None for c in chunks):
            q = flat.new_zeros(n, width, vocab)  # (N, K, V)
        drafts = torch.zeros(n, width, dtype=torch.long, device=flat.device)  # (N, K)
        u = torch.zeros(n, width + 1, dtype=torch.float64, device=flat.device)  # (N, K + 1)
        row = 0
        for i, c in enumerate(chunks):
            m = len(c.draft_token_ids)
            p[i, : m + 1] = flat[row : row + m + 1]
            row += m + 1
            if m:
                drafts[i, :m] = torch.tensor(c.draft_token_ids, device=flat.device)
            if q is not None and m:
                if c.draft_probs is None:  # one-hot guesses beside a probabilistic proposer
                    q[i, :m].scatter_(1, drafts[i, :m].unsqueeze(1), 1.0)
                else:
                    q[i, :m] = c.draft_probs
            if not is_greedy(c.seq.params):
                draws = torch.rand(m + 1, generator=c.seq.generator, dtype=torch.float64,
                                   device=flat.device)  # (m + 1,) one per decision
                u[i, :m] = draws[:m]
                u[i, width] = draws[m]
        num_drafts = torch.tensor([len(c.draft_token_ids) for c in chunks], device=flat.device)
        accepted, final = accept(p, q, drafts, num_drafts, u)
        out: list[list[int]] = []
        for c, a, t in zip(chunks, accepted.tolist(), final.tolist(), strict=True):
            out.append(c.draft_token_ids[:a] + [t])
            self._note(c.seq, len(c.draft_token_ids), a)
        return out

    def _note(self, seq: Sequence, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        self.stats.verify_steps += 1
        st = seq.spec
        st.acceptance = (1 - EMA) * st.acceptance + EMA * accepted / proposed
        if accepted == proposed:
            st.backoffs = 0  # drafts are landing again: back off briefly next time
        if st.acceptance < self.min_acceptance:
            # Exponential: a sequence whose drafts never land (a chat answer with nothing to
            # copy, a draft model of another family) soon stops paying for probes.
            st.skip_steps = min(BACKOFF_STEPS << st.backoffs, MAX_BACKOFF_STEPS)
            st.backoffs += 1
            # The next probe decides at once: one more failed step backs off again, a step with
            # half its drafts accepted keeps speculating.
            st.acceptance = self.min_acceptance + 0.05
