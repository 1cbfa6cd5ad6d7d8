"""Top-k and top-p as candidate sets: the tokens a sampled row may still draw (step 4 of
engine_worker/sampler.py's data flow).

    penalized logits (B, V), the sampled rows -> temperature -> top-k / top-p per row
      -> Candidates groups: rows sharing one width W, their scaled logits (C, W) best first and
         token ids (None: a row that filters nothing keeps the whole vocabulary in id order)
      -> Candidates.draw (one token per row, inverse CDF) or .dense (the (C, V) distribution)

Rows that filter keep only their best tokens (top_k of them; for top-p alone 64, widened to
NUCLEUS_CANDIDATES and then the whole sorted vocabulary only for rows whose nucleus is wider), so
a draw costs the candidates, not the vocabulary, and no row sorts the whole vocabulary unless its
nucleus needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_worker.step import SamplerInput
from protocol.messages import SamplingParams

NUCLEUS_CANDIDATES = 1024  # top-p looks at this many best tokens before falling back to a sort


def top_k_active(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab


@dataclass
class Candidates:
    """Sampled rows sharing one candidate width: temperature-scaled logits of the tokens that
    survived top-k/top-p (removed ones at -inf), and their token ids (None: the whole vocabulary,
    in id order, for rows that filter nothing)."""

    rows: list[int]  # batch rows
    logits: torch.Tensor  # (C, W)
    ids: torch.Tensor | None  # (C, W) token ids, best first

    def draw(self, gens: list[torch.Generator]) -> torch.Tensor:
        """One token per row by inverse CDF over the candidates, each row its own generator."""
        # float64: exact enough over the whole vocabulary, and cheap over a few candidates.
        cdf = torch.softmax(self.logits, dim=-1, dtype=torch.float64).cumsum_(dim=-1)  # (C, W)
        device = self.logits.device
        u = torch.stack(
            [torch.rand((), generator=g, dtype=torch.float64, device=device) for g in gens]
        )  # (C,) exactly one draw per row and step
        target = (u * cdf[:, -1]).unsqueeze(1)  # (C, 1) scaled: the total may be 1 - epsilon
        # The first index whose CDF exceeds u; a removed token adds no width, so never chosen.
        picked = torch.searchsorted(cdf, target, right=True)  # (C, 1)
        picked = picked.clamp_max_(self.logits.shape[1] - 1)
        if self.ids is None:
            return picked.squeeze(1)
        return self.ids.gather(1, picked).squeeze(1)  # (C,)

    def dense(self, vocab: int) -> torch.Tensor:
        probs = torch.softmax(self.logits, dim=-1)  # (C, W)
        if self.ids is None:
            return probs
        return torch.zeros(len(self.rows), vocab, device=probs.device).scatter_(1, self.ids, probs)


def candidates(
    work: torch.Tensor, sampled: list[int], inputs: list[SamplerInput]
) -> list[Candidates]:
    """Temperature, then top-k and top-p, on the sampled rows of the penalized logits `work`.

    Rows that filter keep only their best tokens (top_k of them; for top-p alone 64, widened to
    NUCLEUS_CANDIDATES and then the whole sorted vocabulary only for rows whose nucleus is wider);
    nothing past them is touched again, so a draw costs the candidates, not the vocabulary."""
    vocab = work.shape[1]
    device = work.device
    params = [inputs[i].params for i in sampled]
    temps = torch.tensor([p.temperature for p in params], device=device)  # (S,)
    z = work[sampled] / temps.unsqueeze(1)  # (S, V)
    filt = [j for j, p in enumerate(params) if top_k_active(p, vocab) or p.top_p < 1.0]
    plain = [j for j in range(len(sampled)) if j not in set(filt)]
    groups: list[Candidates] = []
    if plain:
        groups.append(Candidates([sampled[j] for j in plain], z[plain], None))
    if not filt:
        return groups
    k_rows = [j for j in filt if top_k_active(params[j], vocab)]
    p_rows = [j for j in filt if not top_k_active(params[j], vocab)]
    if k_rows:
        # top-k bounds the candidates: never short.
        width = max(params[j].top_k for j in k_rows)
        groups += _filtered(z, k_rows, sampled, params, [width])
    if p_rows:
        # top-p alone: most nuclei of a real model fit in a few dozen tokens; widen only the
        # rows that fall short (a flat distribution), last over the whole vocabulary.
        groups += _filtered(z, p_rows, sampled, params, [64, NUCLEUS_CANDIDATES, vocab])
    return groups


def _filtered(
    z: torch.Tensor, js: list[int], sampled: list[int], params: list[SamplingParams],
    widths: list[int],
) -> list[Candidates]:
    """Candidates of rows `js` of z, trying each width in turn for the rows still short."""
    vocab = z.shape[1]
    device = z.device
    chosen = [params[j] for j in js]
    has_k = torch.tensor([top_k_active(p, vocab) for p in chosen], device=device)  # (F,)
    top_k = torch.tensor([p.top_k if top_k_active(p, vocab) else vocab for p in chosen],
                         device=device)  # (F,)
    # top_p >= 1 means off: +inf keeps every top-k survivor even if float sums reach 1 early.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in chosen],
                         device=device)  # (F,)
    zf = z[js]  # (F, V)
    rows = [sampled[j] for j in js]
    pending = list(range(len(js)))  # indexes into js still to place
    groups: list[Candidates] = []
    for w in [min(w, vocab) for w in widths]:
        sel = pending
        vals, idx, short = _top_k_top_p(zf[sel], has_k[sel], top_k[sel], top_p[sel], w)
        if w == vocab:
            short = torch.zeros_like(short)  # the whole vocabulary cannot fall short
        done = (~short).nonzero().squeeze(1).tolist()
        if done:
            groups.append(Candidates([rows[sel[d]] for d in done], vals[done], idx[done]))
        pending = [sel[d] for d in short.nonzero().squeeze(1).tolist()]
        if not pending:
            break
    return groups


def _top_k_top_p(
    zf: torch.Tensor, has_k: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Filter rows looking only at their `width` best tokens (width >= every top_k).

    Returns the candidates' logits (removed ones at -inf) and token ids, best first, and per row
    whether its nucleus may extend past the candidates.
    """
    vals, idx = torch.topk(zf, width, dim=-1)  # (F, W) (F, W), best first
    pos = torch.arange(width, device=zf.device)  # (W,)
    vals = vals.masked_fill(pos >= top_k.unsqueeze(1), float("-inf"))  # (F, W) top-k
    # top-p runs on the renormalized top-k distribution; without top-k the candidates are only
    # part of the row, so normalize by the whole row.
    norm = torch.logsumexp(vals, -1)  # (F,)
    if not bool(has_k.all()):
        norm = torch.where(has_k, norm, torch.logsumexp(zf, -1))  # (F,)
    probs = torch.exp(vals - norm.unsqueeze(1))  # (F, W)
    # Mass strictly above each token: a token is kept while the ones above it have not yet
    # reached top_p, which yields the smallest set with mass >= top_p.
    before = torch.cumsum(probs, dim=-1) - probs  # (F, W)
    keep = before < top_p.unsqueeze(1)  # (F, W)
    keep[:, 0] = True  # the top token always survives, even with top_p <= 0
    vals = vals.masked_fill(~keep, float("-inf"))  # (F, W)
    short = ~has_k & (probs.sum(-1) < top_p)  # (F,)
    return vals, idx, short
