"""Per-sequence sampling: one row of logits in, one token (and its logprobs) out, per sequence.

Data flow for one decode step, `Sampler()(logits, inputs)` with logits (B, V), one row per sequence:

1. raw logprobs: `log_softmax` of the logits exactly as the model produced them, only for rows that
   asked for logprobs (see "Logprobs" below).
2. adjustments (all rows, greedy ones included, as in OpenAI/vLLM), in this order:
   penalties: for each token t,
   `logit[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]`, where count is
   over this sequence's generated tokens only (never the prompt, never other sequences);
   repetition_penalty r (vLLM's, multiplicative): a token seen in the prompt or the output has
   its logit divided by r where positive, multiplied by r where negative;
   logit_bias: each listed token's bias added (OpenAI's -100..100: -100 bans, +100 forces);
   min_tokens: while fewer tokens were generated, the EOS ids (unless ignore_eos) and the
   request's stop_token_ids are -inf;
   then the structured-output mask, then min_p (sampled rows): a token whose probability at
   the row's temperature is below min_p x the most probable one's is -inf.
3. greedy rows (temperature < 1e-5): argmax of the adjusted logits. No RNG is touched.
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
avoid a full-vocab sort (engine_worker/candidates.py): they look at the best `NUCLEUS_CANDIDATES`
tokens (or top_k, if larger) and sort the whole row only for a row whose nucleus is wider than
that; the draw then works on those candidates, never on a full-vocabulary float64 CDF.

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

import math
from collections.abc import Iterable

import torch

from engine_worker.candidates import candidates
from engine_worker.logprobs import with_logprobs
from engine_worker.step import SampleResult, SamplerInput
from protocol.messages import SamplingParams

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


def adjusts_logits(params: SamplingParams) -> bool:
    """Whether anything but temperature, top-k and top-p changes this row's distribution: a
    greedy row that does not is the argmax of the raw logits (speculation's fast path)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.logit_bias
                or params.repetition_penalty != 1.0 or params.min_tokens or params.min_p)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x (R, V) float -> (R,) int64: torch's argmax of each row (the first maximum; a NaN counts
    as the largest). torch's argmax over a row is a scalar loop on the CPU (140 us for one of the
    151,936 Qwen ids, Zen 4), and a greedy step, a draft pass and a verification each take one
    per row. On the CPU: numpy's argmax of the rows as float32 (exact for every float dtype the
    logits may have), vectorized with the same semantics: 15 us hot, and 85 us right after the
    pass that wrote the logits, where block maxima by torch (then the argmax inside one block)
    took 39 and 225: their reductions read the rows twice, and the first read of rows the
    kernel's other thread wrote is the slow one. Under the AVX2 caps (numpy's and torch's),
    hot: 12 us against 29, five rows 49 against 74."""
    if x.device.type != "cpu":
        return x.argmax(-1)
    return torch.from_numpy(x.detach().float().numpy().argmax(-1))


def plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that adjusts the logits: the token is the raw logits' argmax, and no
    distribution need be made (a draft's, or the verification's)."""
    return is_greedy(params) and not adjusts_logits(params)


class Sampler:
    """Stateless: all per-sequence state (generator, output tokens) lives in the inputs. The
    model's EOS ids are what min_tokens holds back."""

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

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

        adjusted = self._adjusted(work, inputs)  # (B, V)
        if allowed is not None:  # structured output: a token the grammar forbids is never drawn
            masked = torch.where(allowed, adjusted, float("-inf"))  # (B, V) one op, out of place
            dead = ~torch.isfinite(masked).any(dim=-1)  # (B,)
            if bool(dead.any()):  # the grammar allows only the end that min_tokens holds back:
                loose = torch.where(allowed, self._adjusted(work, inputs, hold=False),
                                    float("-inf"))  # the grammar wins: it may end
                masked = torch.where(dead.unsqueeze(1), loose, masked)
            adjusted = masked
        work = _min_p(adjusted, inputs)  # (B, V)
        token_ids = torch.zeros(len(inputs), dtype=torch.long, device=device)  # (B,)
        greedy = [i for i, x in enumerate(inputs) if is_greedy(x.params)]
        sampled = [i for i, x in enumerate(inputs) if not is_greedy(x.params)]
        if greedy:
            token_ids[greedy] = argmax_rows(work[greedy])  # (G,)
        if sampled:
            for cands in candidates(work, sampled, inputs):
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
        work = _min_p(self._adjusted(logits.float(), inputs), inputs)  # (B, V)
        out = torch.zeros_like(work)  # (B, V)
        greedy = [i for i, x in enumerate(inputs) if is_greedy(x.params)]
        sampled = [i for i, x in enumerate(inputs) if not is_greedy(x.params)]
        if greedy:
            out[greedy] = out[greedy].scatter_(1, argmax_rows(work[greedy])[:, None], 1.0)
        if sampled:
            for cands in candidates(work, sampled, inputs):
                out[cands.rows] = cands.dense(work.shape[1])  # (C, V)
        return out


    def _adjusted(self, work: torch.Tensor, inputs: list[SamplerInput],
                  hold: bool = True) -> torch.Tensor:
        """Step 2 of the module's data flow up to the structured-output mask, out of place;
        `hold` False: without min_tokens (for a row whose grammar allows only its end)."""
        work = _penalized(work, inputs)
        work = _repetition(work, inputs)
        work = _biased(work, inputs)
        return _held_back(work, inputs, self.eos_token_ids) if hold else work


def _rows(work: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.long, device=work.device),)


def _repetition(work: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """vLLM's repetition_penalty over the prompt's and the output's tokens."""
    rows = [i for i, x in enumerate(inputs) if x.params.repetition_penalty != 1.0]
    if not rows:
        return work
    vocab, device = work.shape[1], work.device
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)  # (P, V + 1)
    for r, i in enumerate(rows):
        ids = [*inputs[i].prompt_token_ids, *inputs[i].output_token_ids]
        if ids:
            seen[r, torch.tensor(ids, dtype=torch.long, device=device).clamp_(0, vocab)] = True
    seen = seen[:, :vocab]  # (P, V)
    penalty = torch.tensor([inputs[i].params.repetition_penalty for i in rows],
                           device=device).unsqueeze(1)  # (P, 1)
    w = work[rows]  # (P, V)
    w = torch.where(seen, torch.where(w > 0, w / penalty, w * penalty), w)
    return work.index_put(_rows(work, rows), w)


def _biased(work: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """logit_bias: one scatter over every (row, token, bias) of the batch."""
    triples = [(i, t, b) for i, x in enumerate(inputs) for t, b in x.params.logit_bias]
    if not triples:
        return work
    rows, cols, bias = zip(*triples, strict=True)
    device = work.device
    return work.index_put((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                          torch.tensor(bias, dtype=work.dtype, device=device), accumulate=True)


def _held_back(work: torch.Tensor, inputs: list[SamplerInput],
               eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """min_tokens: the ends (EOS unless ignored, stop_token_ids) are -inf until it is reached."""
    pairs = [(i, t) for i, x in enumerate(inputs)
             if len(x.output_token_ids) < x.params.min_tokens
             for t in {*x.params.stop_token_ids,
                       *(() if x.params.ignore_eos else eos_token_ids)}]
    if not pairs:
        return work
    rows, cols = zip(*pairs, strict=True)
    device = work.device
    return work.index_put((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                          torch.tensor(float("-inf"), dtype=work.dtype, device=device))


def _min_p(work: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """min_p on sampled rows: p(t) / p(best) = exp((l_t - l_best) / T) >= min_p, in logits."""
    rows = [i for i, x in enumerate(inputs) if x.params.min_p > 0 and not is_greedy(x.params)]
    if not rows:
        return work
    device = work.device
    w = work[rows]  # (P, V)
    floor = torch.tensor([x.params.temperature * math.log(x.params.min_p)
                          for x in (inputs[i] for i in rows)], device=device).unsqueeze(1)
    keep = w >= w.max(dim=-1, keepdim=True).values + floor  # (P, V); the best always kept
    return work.index_put(_rows(work, rows), torch.where(keep, w, float("-inf")))


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


def _generator_for(x: SamplerInput, device: torch.device) -> torch.Generator:
    if x.generator is not None:
        return x.generator
    if x.params.seed is not None:
        # A generator rebuilt from the seed at every step would repeat the same draw.
        raise ValueError("a seeded sampled sequence needs its own generator")
    return make_generator(None, device)  # unseeded: a throwaway, global RNG untouched
