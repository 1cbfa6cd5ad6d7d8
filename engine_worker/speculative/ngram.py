"""Prompt lookup as a speculative proposer: drafts copied from earlier in the sequence.

    seq.token_ids --index every n-gram once (incrementally, kept in seq.spec.proposer)-->
    longest suffix seen before --> the tokens that followed it (one-hot drafts, no model)
"""

from __future__ import annotations

import torch

from engine_worker.sequence import Sequence
from engine_worker.speculative.state import StepSeconds


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

    def propose(self, seqs: list[Sequence], limits: list[int], target_step_s: StepSeconds = None
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        return [(self._lookup(seq, k), None) for seq, k in zip(seqs, limits, strict=True)]

    def release(self, seq: Sequence) -> None:
        seq.spec.proposer = None

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        index = seq.spec.proposer
        if not isinstance(index, _NgramIndex):
            index = seq.spec.proposer = _NgramIndex()
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
