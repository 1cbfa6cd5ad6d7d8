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
   never fewer than the top one), then draw by inverse CDF: one uniform u from the row's own
   `torch.Generator`, the token is the first whose float64 cumulative probability exceeds u.

Every step is batched over the rows that need it; only the one-number draw per row loops. That
matters more than it looks: a per-row op on a (V,) row costs a whole op's dispatch (a kernel launch
on a GPU, a thread-pool wake-up on a busy CPU), and 64 of them dwarf the arithmetic. Top-k/top-p
avoid a full-vocab sort: they look at the best `NUCLEUS_CANDIDATES` tokens (or top_k, if larger)
and sort the whole row only for a row whose nucleus is wider than that.

Reproducibility: each sampled row draws exactly one uniform from its own generator per step,
whatever its params, its position in the batch, or who else is in it, and every batched op works
row by row. The same seed with the same logits therefore gives the same tokens alone or in any
batch (bit for bit on CPU; on a GPU, up to rounding that a different kernel choice could bring).
Greedy rows never advance a generator. The engine makes one generator per sequence with
`make_generator` when the sequence starts and hands it back every step; a sequence without a seed
still gets its own, randomly seeded one, so no global RNG state is read or written.

Logprobs (a documented choice): the logprobs returned are log_softmax of the RAW model logits,
before penalties, temperature and top-k/top-p, like vLLM's default "raw_logprobs". `logprob` is the
chosen token's, and `top_logprobs` the k best (token_id, logprob) by that same distribution, best
first, k = params.logprobs (0 gives an empty list). They describe what the model believed, not the
filtered distribution the token was drawn from, so a greedy and a sampled request report alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.messages import SamplingParams

NUCLEUS_CANDIDATES = 1024  # top-p looks at this many best tokens before falling back to a sort
GREEDY_EPS = 1e-5  # temperatures below this are greedy: dividing by them would overflow
_SEED_MASK = (1 << 64) - 1  # torch seeds are 64-bit; masking maps negative OpenAI seeds into range


@dataclass
class SamplerInput:
    """What the sampler needs to know about one sequence for one step."""

    params: SamplingParams
    output_token_ids: list[int]  # this sequence's generated tokens so far (for penalties)
    generator: torch.Generator | None  # per-sequence RNG from make_generator, kept by the engine


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # set when params.logprobs is not None
    top_logprobs: list[tuple[int, float]] | None  # k best (token_id, logprob), best first


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
            params = [inputs[i].params for i in sampled]
            temps = torch.tensor([p.temperature for p in params], device=device)  # (S,)
            z = work[sampled] / temps.unsqueeze(1)  # (S, V)
            _filter_(z, params)  # (S, V) removed tokens now at -inf
            gens = [_generator_for(inputs[i], device) for i in sampled]
            token_ids[sampled] = _draw(z, gens)  # (S,)

        tokens = token_ids.tolist()
        if raw_lp is None:
            return [SampleResult(t, None, None) for t in tokens]
        return _with_logprobs(tokens, raw_lp, want_lp, inputs)


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


def _filter_(z: torch.Tensor, params: list[SamplingParams]) -> None:
    """Top-k then top-p, in place on the scratch rows z, on the rows that set them."""
    vocab = z.shape[1]
    rows = [j for j, p in enumerate(params) if _top_k_active(p, vocab) or p.top_p < 1.0]
    if not rows:
        return
    chosen = [params[j] for j in rows]
    ks = [p.top_k if _top_k_active(p, vocab) else vocab for p in chosen]
    has_k = torch.tensor([_top_k_active(p, vocab) for p in chosen], device=z.device)  # (F,)
    top_k = torch.tensor(ks, device=z.device)  # (F,)
    # top_p >= 1 means off: +inf keeps every top-k survivor even if float sums reach 1 early.
    ps = [p.top_p if p.top_p < 1.0 else float("inf") for p in chosen]
    top_p = torch.tensor(ps, device=z.device)  # (F,)
    zf = z[rows]  # (F, V)
    # Candidates: enough for every top_k, and NUCLEUS_CANDIDATES for rows with top-p alone.
    no_k = vocab in ks
    width = min(vocab, max([NUCLEUS_CANDIDATES if no_k else 1] + [k for k in ks if k < vocab]))
    kept, short = _top_k_top_p(zf, has_k, top_k, top_p, width)  # (F, V) (F,)
    if no_k and bool(short.any()):
        # Rare: a nucleus wider than the candidates (a flat distribution). Redo those rows over
        # the whole vocabulary, where no row can fall short.
        kept[short] = _top_k_top_p(zf[short], has_k[short], top_k[short], top_p[short], vocab)[0]
    z[rows] = kept


def _top_k_top_p(
    zf: torch.Tensor, has_k: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Filter rows looking only at their `width` best tokens (width >= every top_k).

    Returns the filtered rows and, per row, whether its nucleus may extend past the candidates.
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
    out = torch.full_like(zf, float("-inf")).scatter_(1, idx, vals)  # (F, V)
    return out, short


def _generator_for(x: SamplerInput, device: torch.device) -> torch.Generator:
    if x.generator is not None:
        return x.generator
    if x.params.seed is not None:
        # A generator rebuilt from the seed at every step would repeat the same draw.
        raise ValueError("a seeded sampled sequence needs its own generator")
    return make_generator(None, device)  # unseeded: a throwaway, global RNG untouched


def _draw(z: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """One sample per row of softmax(z) by inverse CDF, each row with its own generator."""
    # float64 so that the cumulative sum over the whole vocabulary does not drift.
    cdf = torch.softmax(z, dim=-1, dtype=torch.float64).cumsum_(dim=-1)  # (S, V)
    u = torch.stack(
        [torch.rand((), generator=g, dtype=torch.float64, device=z.device) for g in gens]
    )  # (S,) exactly one draw per row and step
    target = (u * cdf[:, -1]).unsqueeze(1)  # (S, 1) scaled: the total may be 1 - epsilon
    # The first index whose CDF exceeds u; a removed token adds no width, so it is never chosen.
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)  # (S,)
    return picked.clamp_max_(z.shape[1] - 1)


def _with_logprobs(
    tokens: list[int], raw_lp: torch.Tensor, want: list[int], inputs: list[SamplerInput]
) -> list[SampleResult]:
    """Results, with the raw logprobs of the chosen token and the k best for rows that asked."""
    device = raw_lp.device
    chosen_ids = torch.tensor([tokens[i] for i in want], device=device)  # (L,)
    chosen = raw_lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()  # (L,)
    k_max = min(max(inputs[i].params.logprobs or 0 for i in want), raw_lp.shape[1])
    top_vals, top_idx = torch.topk(raw_lp, k_max, dim=-1)  # (L, K) (L, K), best first
    top_vals_l, top_idx_l = top_vals.tolist(), top_idx.tolist()
    row_of = {i: r for r, i in enumerate(want)}
    results: list[SampleResult] = []
    for i, (token, x) in enumerate(zip(tokens, inputs, strict=True)):
        r = row_of.get(i)
        if r is None:
            results.append(SampleResult(token, None, None))
            continue
        k = x.params.logprobs or 0
        top = list(zip(top_idx_l[r][:k], top_vals_l[r][:k], strict=True))
        results.append(SampleResult(token, chosen[r], top))
    return results
