"""Constrained decoding in the worker: one llguidance matcher per sequence, one token mask per step.

Data flow for a request that carries a grammar (`Generate.grammar`, llguidance's JSON grammar
string, built and validated by the gateway's `gateway.prompt.structured`):

    Engine.add ──GrammarCompiler.matcher(grammar)──▶ one GrammarMatcher per choice (sequence)
    Engine._sample:  allowed_tokens(matchers) ──▶ (S, V) bool mask ──▶ Sampler (after penalties,
                     before temperature/top-k/top-p and the draw) ──▶ tokens ──▶ advance(matchers)

Invariants: a matcher has consumed exactly the sequence's committed output tokens; each row of the
mask allows at least one token (a matcher in an error state, which the mask makes unreachable,
allows only EOS, so the sequence ends instead of sampling from an all -inf row). When the grammar
is complete the matcher allows only EOS, and the scheduler's EOS check ends the sequence with
"stop". Preemption recomputes the KV cache but keeps the output tokens, so matchers need no rollback
there. Constrained requests do not speculate today (engine.add turns it off for them); a future
verifier that checks drafts against the grammar must roll back (`GrammarMatcher.rollback`)
exactly the draft tokens it advanced but did not accept.

llguidance computes each row's mask in Rust (~7 us median for SmolLM2's 49k vocabulary under a
JSON schema), row after row in the engine's own thread. Its parallel LLExecutor was slower here:
on a 2-core host its worker threads fight torch's OpenMP threads, which spin after each op, and a
step's mask went from ~0.1 ms to ~100 ms at batch 16 (benchmarks/bench_structured.py). No torch
in llguidance itself: it reads tokenizer.json.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask


class GrammarError(ValueError):
    """A grammar the matcher refused (the gateway validates first; this is the worker's guard)."""


class GrammarMatcher:
    """The parse state of one sequence's output under one grammar."""

    def __init__(self, matcher: LLMatcher, eos_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids

    def advance(self, token_id: int) -> None:
        """Consume one committed token. An EOS after completion is the normal end: not fed."""
        if self.matcher.is_stopped() and token_id in self.eos_token_ids:
            return
        self.matcher.consume_token(token_id)  # a refused token leaves it in its error state

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` advances (draft tokens a verifier rejected)."""
        self.matcher.rollback(num_tokens)

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


class GrammarCompiler:
    """Builds matchers for one model's tokenizer.

    llguidance's tokenizer is built on the first grammar, not at start: it holds about 130 MiB
    for a 151,936-token vocabulary (0.7 s to build; 0.2 s for SmolLM2's 49k), which a worker
    that never sees structured output should not carry (issue 39's memory). The first grammar
    is built on the grammar thread (grammar_builds), but llguidance holds the GIL while it
    builds the tokenizer: running streams wait that long once, on a worker's first grammar."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        if not eos_token_ids:
            raise ValueError("constrained decoding needs at least one EOS token id")
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer_json: str | None = tokenizer_json
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                              eos_token=self.eos_token_ids)
                self._tokenizer_json = None
            return self._tokenizer

    @property
    def built(self) -> bool:
        """Whether llguidance's tokenizer is built yet (the first grammar builds it)."""
        return self._tokenizer is not None

    def matcher(self, grammar: str) -> GrammarMatcher:
        # log_level 0: a refused token is an error state we check, not a line on stderr.
        inner = LLMatcher(self.tokenizer, grammar, log_level=0)
        if inner.is_error():
            raise GrammarError(f"invalid grammar: {inner.get_error()}")
        return GrammarMatcher(inner, self.eos_token_ids)

    def matchers(self, grammar: str, n: int) -> list[GrammarMatcher]:
        """n fresh matchers (one per choice): compiled once, then copied, which is cheaper."""
        first = self.matcher(grammar)
        return [first] + [GrammarMatcher(first.matcher.deep_copy(), self.eos_token_ids)
                          for _ in range(n - 1)]

    def allowed_tokens(self, matchers: list[GrammarMatcher | None],
                       device: torch.device | str = "cpu") -> torch.Tensor | None:
        """(S, V) bool, True where row i may sample the token; None when no row is constrained.

        Unconstrained rows are all True, so one mask serves the whole sampled batch."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        vocab = self.vocab_size
        bitmask = allocate_token_bitmask(len(matchers), vocab)  # (S, ceil(V / 32)) int32, all -1
        for m, i in rows:
            fill_next_token_bitmask(m.matcher, bitmask, i)
        # Bit j of word w is token 32 * w + j: little-endian bit order over the bytes.
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for m, i in rows:
            if m.failed:
                bits[i] = 0
        # A row with nothing allowed is unreachable under the mask; if it happens anyway (a
        # matcher in an error state), allow only EOS so the sequence ends cleanly. Unconstrained
        # rows are all ones, so never empty.
        for i in np.flatnonzero(~bits.any(axis=1)):  # (S,) one numpy op, not one per row
            bits[i, self.eos_token_ids] = 1
        # unpackbits yields 0/1 bytes: viewed as bool with no copy and no torch op on CPU.
        return torch.from_numpy(bits.view(np.bool_)).to(device)  # (S, V)


def advance_all(matchers: list[GrammarMatcher | None], token_ids: list[int]) -> None:
    """The one place where sampled tokens are fed to their matchers (row i -> token i)."""
    for m, token in zip(matchers, token_ids, strict=True):
        if m is not None:
            m.advance(token)
