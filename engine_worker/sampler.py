"""Per-sequence sampling: one row of logits in, one token (and its logprobs) out, per sequence.

Data flow for one decode step, `Sampler()(logits, inputs)` with logits (B, V), one row per sequence:

1. raw logprobs: `log_softmax` of the logits exactly as the model produced them, only for rows that
   asked for logprobs (see "Logprobs" below).
2. penalties (all rows, greedy ones included, as in OpenAI/vLLM): for each token t,
   `logit[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]`, where count is
   over this sequence's generated tokens only (never the prompt, never other sequences).
3. greedy rows (temperature < 1e-5): argmax of the penalized logits. No RNG is touched.
4. sampled rows: divide by temperature, keep the top_k tokens (0 or -1: off), then the nucleus
   (the smallest set of tokens whose probability mass is >= top_p after top-k renormalization,
   never fewer than the top one), then draw by inverse CDF over the surviving candidates only
   (best first): one uniform u from the row's own `torch.Generator`, the token is the first whose
   float64 cumulative probability exceeds u. A row that filters nothing draws over the whole
   vocabulary in id order. `Sampler.probs` gives the same distributions as dense rows, for
   speculative acceptance.

Every step is batched over the rows that need it; only the one-number draw per row loops. That
matters more than it looks: a per-row op on a (V,) row costs a whole op's dispatch (a kernel launch
on a GPU, a thread-pool wake-up on a busy CPU), and 64 of them dwarf the arithmetic. Top-k/top-p
avoid a full-vocab sort: they look at the best `NUCLEUS_CANDIDATES` tokens (or top_k, if larger)
and sort the whole row only for a row whose nucleus is wider than that; the draw then works on
those candidates, never on a full-vocabulary float64 CDF.

Reproducibility: each sampled row draws exactly one uniform from its own generator per call,
whatever its params, its position in the batch, or who else is in it, and every batched op works
row by row. The same seed with the same logits therefore gives the same token alone or in any
batch (bit for bit on CPU; on a GPU, up to rounding that a different kernel choice could bring).
Greedy rows never advance a generator. Speculative decoding draws from the same generator
(drafts, and one uniform per verified position: engine_worker/speculative/), and whether a step
speculates depends on the batch (its size, the token budget), so a seeded sampled sequence keeps
its tokens across batches only while speculation is off for it. The engine makes one generator
per sequence with `make_generator` when the sequence starts and hands it back every step; a
sequence without a seed still gets its own, randomly seeded one, so no global RNG state is read
or written.

Logprobs (a documented choice): the logprobs returned are log_softmax of the RAW model logits,
before penalties, temperature and top-k/top-p, like vLLM's default "raw_logprobs". `logprob` is the
chosen token's, and `top_logprobs` the k best (token_id, logprob) by that same distribution, best
first, k = params.logprobs (0 gives an empty list). They describe what the model believed, not the
filtered distribution the token was drawn from, so a greedy and a sampled request report alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_worker.logprobs import with_logprobs
from engine_worker.step import SampleResult, SamplerInput
from protocol.messages import SamplingParams

NUCLEUS_CANDIDATES = 1024  # top-p looks at this many best tokens before falling back to a sort
GREEDY_EPS = 1e-5  # temperatures below this are greedy: dividing by them would overflow
_SEED_MASK = (1 << 64) - 1  # torch seeds are 64-bit; masking maps negative OpenAI seeds into range


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private RNG for one sequence. `None` seeds it from the OS, still without global state."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()  # non-deterministic seed; touches only this generator
    else:
        gen.manual_seed(seed & _SEED_MASK)
    return gen


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_EPS


def _top_k_active(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab


class Sampler:
    """Stateless: all per-sequence state (generator, output tokens) lives in the inputs."""

    def __call__(self, logits: torch.Tensor, inputs: list[SamplerInput],
                 allowed: torch.Tensor | None = None) -> list[SampleResult]:
        """`allowed`: an optional (B, V) bool mask from constrained decoding (engine_worker/
        grammar.py), applied after the penalties and before greedy/temperature/top-k/top-p."""
        if logits.dim() != 2 or logits.shape[0] != len(inputs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(inputs)} inputs")
        device = logits.device
        # Never modified in place: every change below makes a new tensor, so the caller's
        # logits survive whatever their dtype.
        work = logits.float()  # (B, V)
        want_lp = [i for i, x in enumerate(inputs) if x.params.logprobs is not None]
        # Raw logprobs are taken before the penalties change `work`, and only for rows that asked.
        raw_lp = torch.log_softmax(work[want_lp], dim=-1) if want_lp else None  # (L, V)

        work = _penalized(work, inputs)  # (B, V)
        if allowed is not None:  # structured output: a token the grammar forbids is never drawn
            work = torch.where(allowed, work, float("-inf"))  # (B, V) one op, out of place
        token_ids = torch.zeros(len(inputs), dtype=torch.long, device=device)  # (B,)
        greedy = [i for i, x in enumerate(inputs) if is_greedy(x.params)]
        sampled = [i for i, x in enumerate(inputs) if not is_greedy(x.params)]
        if greedy:
            token_ids[greedy] = work[greedy].argmax(dim=-1)  # (G,)
        if sampled:
            for cands in _candidates(work, sampled, inputs):
                gens = [_generator_for(inputs[i], device) for i in cands.rows]
                token_ids[cands.rows] = cands.draw(gens)  # (C,)

        tokens = token_ids.tolist()
        if raw_lp is None:
            return [SampleResult(t, None, None) for t in tokens]
        return with_logprobs(tokens, raw_lp, want_lp, inputs)

    def probs(self, logits: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
        """The distribution each row's token would be drawn from, as dense float32 (B, V):
        after penalties, temperature, top-k and top-p; one-hot at the argmax for greedy rows.
        Speculative acceptance compares these (target) with a draft's. No RNG is touched."""
        if logits.dim() != 2 or logits.shape[0] != len(inputs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(inputs)} inputs")
        work = _penalized(logits.float(), inputs)  # (B, V)
        out = torch.zeros_like(work)  # (B, V)
        greedy = [i for i, x in enumerate(inputs) if is_greedy(x.params)]
        sampled = [i for i, x in enumerate(inputs) if not is_greedy(x.params)]
        if greedy:
            out[greedy] = out[greedy].scatter_(1, work[greedy].argmax(-1, keepdim=True), 1.0)
        if sampled:
            for cands in _candidates(work, sampled, inputs):
                out[cands.rows] = cands.dense(work.shape[1])  # (C, V)
        return out


@dataclass
class _Candidates:
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


def _candidates(
    work: torch.Tensor, sampled: list[int], inputs: list[SamplerInput]
) -> list[_Candidates]:
    """Temperature, then top-k and top-p, on the sampled rows of the penalized logits `work`.

    Rows that filter keep only their best tokens (top_k of them; for top-p alone 64, widened to
    NUCLEUS_CANDIDATES and then the whole sorted vocabulary only for rows whose nucleus is wider);
    nothing past them is touched again, so a draw costs the candidates, not the vocabulary."""
    vocab = work.shape[1]
    device = work.device
    params = [inputs[i].params for i in sampled]
    temps = torch.tensor([p.temperature for p in params], device=device)  # (S,)
    z = work[sampled] / temps.unsqueeze(1)  # (S, V)
    filt = [j for j, p in enumerate(params) if _top_k_active(p, vocab) or p.top_p < 1.0]
    plain = [j for j in range(len(sampled)) if j not in set(filt)]
    groups: list[_Candidates] = []
    if plain:
        groups.append(_Candidates([sampled[j] for j in plain], z[plain], None))
    if not filt:
        return groups
    k_rows = [j for j in filt if _top_k_active(params[j], vocab)]
    p_rows = [j for j in filt if not _top_k_active(params[j], vocab)]
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
) -> list[_Candidates]:
    """Candidates of rows `js` of z, trying each width in turn for the rows still short."""
    vocab = z.shape[1]
    device = z.device
    chosen = [params[j] for j in js]
    has_k = torch.tensor([_top_k_active(p, vocab) for p in chosen], device=device)  # (F,)
    top_k = torch.tensor([p.top_k if _top_k_active(p, vocab) else vocab for p in chosen],
                         device=device)  # (F,)
    # top_p >= 1 means off: +inf keeps every top-k survivor even if float sums reach 1 early.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in chosen],
                         device=device)  # (F,)
    zf = z[js]  # (F, V)
    rows = [sampled[j] for j in js]
    pending = list(range(len(js)))  # indexes into js still to place
    groups: list[_Candidates] = []
    for w in [min(w, vocab) for w in widths]:
        sel = pending
        vals, idx, short = _top_k_top_p(zf[sel], has_k[sel], top_k[sel], top_p[sel], w)
        if w == vocab:
            short = torch.zeros_like(short)  # the whole vocabulary cannot fall short
        done = (~short).nonzero().squeeze(1).tolist()
        if done:
            groups.append(_Candidates([rows[sel[d]] for d in done], vals[done], idx[done]))
        pending = [sel[d] for d in short.nonzero().squeeze(1).tolist()]
        if not pending:
            break
    return groups


def _penalized(work: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """Presence/frequency penalties on the rows that set one and have outputs, out of place."""
    rows = [
        i
        for i, x in enumerate(inputs)
        if (x.params.presence_penalty or x.params.frequency_penalty) and x.output_token_ids
    ]
    if not rows:
        return work
    vocab = work.shape[1]
    device = work.device
    longest = max(len(inputs[i].output_token_ids) for i in rows)
    # Pad with `vocab`: pads land in a spare column that is dropped, so rows of any length share
    # one scatter_add.
    padded = [
        inputs[i].output_token_ids + [vocab] * (longest - len(inputs[i].output_token_ids))
        for i in rows
    ]
    ids = torch.tensor(padded, dtype=torch.long, device=device)  # (P, T)
    counts = torch.zeros(len(rows), vocab + 1, device=device)  # (P, V + 1)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    counts = counts[:, :vocab]  # (P, V)
    presence = torch.tensor([inputs[i].params.presence_penalty for i in rows], device=device)
    frequency = torch.tensor([inputs[i].params.frequency_penalty for i in rows], device=device)
    penalty = presence.unsqueeze(1) * (counts > 0) + frequency.unsqueeze(1) * counts  # (P, V)
    return work.index_put((torch.tensor(rows, device=device),), work[rows] - penalty)


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


def _generator_for(x: SamplerInput, device: torch.device) -> torch.Generator:
    if x.generator is not None:
        return x.generator
    if x.params.seed is not None:
        # A generator rebuilt from the seed at every step would repeat the same draw.
        raise ValueError("a seeded sampled sequence needs its own generator")
    return make_generator(None, device)  # unseeded: a throwaway, global RNG untouched
