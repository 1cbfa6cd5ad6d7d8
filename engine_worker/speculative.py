"""Speculative decoding inside the batched engine: propose -> (execute) -> accept.

    Engine.step:  k = spec.lookahead(...)            # 0: plain decoding this step
                  chunks = scheduler.schedule(k)     # decode chunks reserve k draft slots
                  spec.propose(chunks)               # fills chunk.draft_token_ids / draft_probs
                  logits = runner.execute(...)       # drafts scored at every position
                  tokens = spec.accept(...)          # rejection sampling, see acceptance.py
                  scheduler.update(chunks, tokens)   # commits accepted drafts + one token

Proposers sit behind `Proposer` (n-gram prompt lookup here, a draft model in draft_proposer.py);
their per-sequence state lives on the sequence (`seq.proposer_state`).

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
from typing import TYPE_CHECKING, Protocol

import torch

from engine_worker.acceptance import accept
from engine_worker.sampler import Sampler, SamplerInput, is_greedy
from engine_worker.scheduler import ScheduledChunk
from engine_worker.sequence import Sequence

if TYPE_CHECKING:
    from engine_worker.config import WorkerConfig
    from engine_worker.model_runner import ModelRunner

BACKOFF_STEPS = 16  # steps a sequence with failing drafts decodes plainly before probing again
MAX_BACKOFF_STEPS = 256  # the backoff doubles at each failed probe, up to this
EMA = 0.3  # weight of the newest step in a sequence's running acceptance rate


class Proposer(Protocol):
    """Guesses the next tokens of sequences; q is the distribution each guess was drawn from."""

    def propose(self, seqs: list[Sequence], limits: list[int]
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Per sequence, at most `limits[i]` drafts and their (n, V) draft probabilities
        (None: one-hot, i.e. a deterministic guess)."""
        ...

    def release(self, seq: Sequence) -> None:
        """Forget `seq` (finished or aborted): free whatever its state holds."""
        ...


class _NgramIndex:
    """Where each n-gram (n in min_n..max_n) of a sequence last ended, built incrementally."""

    def __init__(self) -> None:
        self.indexed = 0  # n-grams ending before this position are in the maps
        self.last_end: dict[tuple[int, ...], int] = {}
        self.first_end: dict[tuple[int, ...], int] = {}


class NgramProposer:
    """Prompt lookup: find the longest suffix (max_n down to min_n tokens) of prompt + output that
    occurred before, and propose the tokens that followed its latest occurrence (its first, when
    the latest has fewer than k tokens after it). Strong on
    input-grounded work (rewriting, summarising, editing code), where the output copies spans
    of the input. No model, no probabilities: the drafts are one-hot guesses."""

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], limits: list[int]
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        return [(self._lookup(seq, k), None) for seq, k in zip(seqs, limits, strict=True)]

    def release(self, seq: Sequence) -> None:
        seq.proposer_state = None

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        index = seq.proposer_state
        if not isinstance(index, _NgramIndex):
            index = seq.proposer_state = _NgramIndex()
        tokens = seq.token_ids
        last = len(tokens) - 1
        # Index every n-gram ending before the last token; the suffix itself must not match.
        for end in range(index.indexed, last):
            for n in range(self.min_n, self.max_n + 1):
                if end - n + 1 >= 0:
                    key = tuple(tokens[end - n + 1 : end + 1])
                    index.last_end[key] = end
                    index.first_end.setdefault(key, end)
        index.indexed = max(index.indexed, last)
        for n in range(self.max_n, self.min_n - 1, -1):
            if n > len(tokens):
                continue
            key = tuple(tokens[len(tokens) - n :])
            end = index.last_end.get(key)
            if end is not None:
                # The latest occurrence is the likeliest context; in a run that repeats itself
                # it is right behind the suffix and has little after it, so take the first.
                if last - end < k:
                    end = index.first_end[key]
                return list(tokens[end + 1 : end + 1 + k])
        return []


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

    def propose(self, chunks: list[ScheduledChunk]) -> None:
        todo = []
        for c in chunks:
            if c.max_drafts <= 0:
                continue
            if c.seq.spec_skip_steps > 0:
                c.seq.spec_skip_steps -= 1
                continue
            todo.append(c)
        if not todo:
            return
        proposals = self.proposer.propose([c.seq for c in todo], [c.max_drafts for c in todo])
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
        fast = [i for i, c in enumerate(chunks) if _plain_greedy(c.seq)]
        out: list[list[int] | None] = [None] * len(chunks)
        if fast:
            starts, row = [], 0
            for c in chunks:
                starts.append(row)
                row += 1 + len(c.draft_token_ids)
            best = logits.argmax(-1).tolist()  # (rows,)
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
                                           seq.generator))
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
        seq.spec_acceptance = (1 - EMA) * seq.spec_acceptance + EMA * accepted / proposed
        if accepted == proposed:
            seq.spec_backoffs = 0  # drafts are landing again: back off briefly next time
        if seq.spec_acceptance < self.min_acceptance:
            # Exponential: a sequence whose drafts never land (a chat answer with nothing to
            # copy, a draft model of another family) soon stops paying for probes.
            seq.spec_skip_steps = min(BACKOFF_STEPS << seq.spec_backoffs, MAX_BACKOFF_STEPS)
            seq.spec_backoffs += 1
            # The next probe decides at once: one more failed step backs off again, a step with
            # half its drafts accepted keeps speculating.
            seq.spec_acceptance = self.min_acceptance + 0.05


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return is_greedy(p) and not (p.presence_penalty or p.frequency_penalty)


def build_spec_decoder(cfg: WorkerConfig, runner: ModelRunner) -> SpecDecoder | None:
    """The worker's speculative decoder from its settings (None: --speculative-method off)."""
    if cfg.speculative_method == "off":
        return None
    proposer: Proposer
    if cfg.speculative_method == "ngram":
        proposer = NgramProposer()
    else:
        from pathlib import Path

        from engine_worker.draft_proposer import DraftModelProposer
        from engine_worker.model.loader import resolve_checkpoint
        from engine_worker.model_runner import ModelRunner as Runner

        draft = Runner(
            resolve_checkpoint(cfg.draft_model, Path(cfg.cache_dir)),
            dtype=runner.dtype, device=str(runner.device),
            kv_budget_bytes=cfg.kv_cache_mb * 2**20, block_size=cfg.block_size,
            paged_attention=cfg.paged_attention, cache_dir=Path(cfg.cache_dir),
        )
        if draft.config.vocab_size != runner.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) is not "
                             f"the served model's ({runner.config.vocab_size})")
        proposer = DraftModelProposer(draft)
    return SpecDecoder(proposer, cfg.num_speculative_tokens,
                       max_batch=cfg.speculative_max_batch,
                       min_acceptance=cfg.speculative_min_acceptance)
