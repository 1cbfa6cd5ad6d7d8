"""The draft's head over the vocabulary's ASCII-rich prefix, for text that stays in it.

    at start: hot_prefix(every id's text) -> cut (None: no such prefix worth cutting); the
      ids past it whose text is not ASCII are the cold ones
      Qwen2.5's 151,936 ids: 94-97 % of each 16 K window below 98,304 decode to ASCII, 0-5 %
      above (CJK, Cyrillic, Arabic, Hangul merges), so cut = 98,304; SmolLM2's 49,152 are
      ASCII-rich throughout: None
    HotHead(draft model, cut) replaces the draft's integer-dot head
    a draft pass whose every sequence is plain greedy with no cold id in its text yet
      -> logits (B, cut): the head reads cut of its rows (the 0.5B Qwen's Q4_0 head: 49.5 of
         76.5 MB; a pass 9.65 ms against 10.47, Zen 4)
    any other pass -> the whole head, as before

Why it is safe: a draft is only a guess the target verifies; a guess limited to the prefix
changes no output, and costs acceptance only where the target's next token lies above the cut
(0.01-0.09 % of this repository's code and docs tokens). A sequence whose prompt or output has
a cold id (a Russian or Japanese text) drafts over the whole vocabulary from then on, so
non-Latin text loses nothing. Sampled sequences (with a q distribution over every id) keep
the whole head too. The chat template's control tokens lie past the cut (Qwen's <|im_end|>):
a hot pass never drafts one, so an answer's end costs one rejected draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from engine_worker import int_dot
from engine_worker.model.int_dot_linear import IntDotLinear

WINDOW = 4096  # ids a window: the prefix ends at the first window mostly not ASCII
MOSTLY = 0.5  # a window's share of ASCII texts below which it is not hot
LEAST_CUT = 1 / 8  # a prefix that leaves less than this share of the ids out is not worth it
ROWS = 16  # the cut is a multiple of the kernel's work item (two tiles of 8 rows)


def hot_prefix(texts: Sequence[str]) -> int | None:
    """The end of the vocabulary's ASCII-rich prefix: the first WINDOW-id window where at
    most MOSTLY of the texts are ASCII starts the cold part. None where no window is cold or
    the cut would leave less than LEAST_CUT of the ids out."""
    n = len(texts)
    for start in range(0, n, WINDOW):
        window = texts[start : start + WINDOW]
        if sum(t.isascii() for t in window) <= MOSTLY * len(window):
            cut = start // ROWS * ROWS
            return cut if cut > 0 and n - cut >= LEAST_CUT * n else None
    return None


class HotHead(nn.Module):
    """The draft model's head, computing ids [0, cut) only while `hot` is set (and its rows
    take the integer-dot kernel); otherwise the whole head as it was. `cold`: the ids past the
    cut whose text says a sequence left the prefix's languages (None: all of them); the chat
    template's control tokens live past it too (Qwen's <|im_start|> is 151,644), but their text
    is ASCII, so a prompt that has them still drafts hot (they are then never drafted: one
    rejected draft where an answer ends)."""

    def __init__(self, head: IntDotLinear, cut: int, cold: frozenset[int] | None = None) -> None:
        super().__init__()
        p = head.packed
        if cut % int_dot.TILE or not 0 < cut < p.n or head.bias is not None:
            raise ValueError(f"a hot head of {cut} rows of {p.n} (a multiple of "
                             f"{int_dot.TILE}, no bias)")
        self.head = head
        self.cut = cut
        tiles = cut // int_dot.TILE
        # views of the head's first rows (not `packed`: the weight counters would count them)
        self.rows = p._replace(n=cut, qs=p.qs[:tiles], d=p.d[:tiles],
                               m=None if p.m is None else p.m[:tiles])
        self.cold = cold
        self.hot = False

    def leaves(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` hold a cold id (the sequence then drafts over every id)."""
        cut, cold = self.cut, self.cold
        return any(t >= cut and (cold is None or t in cold) for t in tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if not (self.hot and rows and x.dtype == torch.float32
                and self.head.path(rows) == "_int_dot"):
            return self.head(x)
        xf = x.reshape(rows, x.shape[-1]).contiguous()
        return int_dot.mm(self.rows, xf).reshape(*x.shape[:-1], self.cut)


def texts_of(model_path: Path, vocab_size: int) -> list[str]:
    """Each id's decoded text (ids past the tokenizer's: "")."""
    from tokenizers import Tokenizer

    from engine_worker.model.tokenizer import tokenizer_info

    tok = Tokenizer.from_str(tokenizer_info(model_path).tokenizer_json)
    n = min(vocab_size, tok.get_vocab_size())
    return tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False) + \
        [""] * (vocab_size - n)


def attach(model: nn.Module, texts: Sequence[str]) -> HotHead | None:
    """Put a HotHead on `model` (a draft) where its vocabulary has a hot prefix and its head is
    an integer-dot layer; None (nothing changed) otherwise."""
    cut = hot_prefix(texts)
    head = getattr(model, "lm_head", None)
    if cut is None or not isinstance(head, IntDotLinear) or head.bias is not None \
            or cut >= head.packed.n:
        return None
    hot = HotHead(head, cut, frozenset(i for i in range(cut, len(texts))
                                       if not texts[i].isascii()))
    model.lm_head = hot
    return hot
