"""engine_worker/sampler.py's controls past temperature, top-k and top-p (issue 40): logit_bias,
repetition_penalty, min_tokens, min_p. Each changes what __call__ draws and what probs() gives
speculative acceptance alike, and a row that asks for none is the raw argmax."""

from __future__ import annotations

import math

import pytest
import torch

from engine_worker.sampler import Sampler, adjusts_logits, make_generator
from engine_worker.step import SamplerInput
from protocol.messages import SamplingParams

V = 50
EOS = 7


def row(best: int, second: int | None = None) -> torch.Tensor:
    """One logits row (1, V): token `best` at 5, `second` at 4, the rest spread below 0."""
    logits = torch.linspace(-3.0, -1.0, V)
    logits[best] = 5.0
    if second is not None:
        logits[second] = 4.0
    return logits.unsqueeze(0)


def inp(output: list[int] | None = None, prompt: tuple[int, ...] = (), seed: int | None = 0,
        **params: object) -> SamplerInput:
    p = SamplingParams(seed=seed, **params)  # type: ignore[arg-type]
    return SamplerInput(p, list(output or []), make_generator(seed), prompt)


def greedy(logits: torch.Tensor, x: SamplerInput, sampler: Sampler | None = None) -> int:
    return (sampler or Sampler([EOS]))(logits, [x])[0].token_id


def test_logit_bias_minus_100_removes_the_greedy_token_and_plus_100_forces_one() -> None:
    logits = row(3, second=9)
    assert greedy(logits, inp(temperature=0)) == 3
    assert greedy(logits, inp(temperature=0, logit_bias=[(3, -100.0)])) == 9
    assert greedy(logits, inp(temperature=0, logit_bias=[(40, 100.0)])) == 40
    # sampled rows too: +100 puts all the mass on it
    draws = {Sampler([EOS])(logits, [inp(seed=s, logit_bias=[(40, 100.0)])])[0].token_id
             for s in range(20)}
    assert draws == {40}


def test_the_callers_logits_are_never_changed() -> None:
    logits = row(3)
    before = logits.clone()
    Sampler([EOS])(logits, [inp(temperature=0, logit_bias=[(3, -100.0)], min_tokens=2,
                                repetition_penalty=1.5, min_p=0.5)])
    assert torch.equal(logits, before)


def test_repetition_penalty_divides_seen_positive_and_multiplies_seen_negative_logits() -> None:
    logits = torch.zeros(1, V)
    logits[0, 1], logits[0, 2], logits[0, 3], logits[0, 4] = 4.0, 3.0, -1.0, -1.2
    sampler = Sampler([EOS])
    probs = sampler.probs(logits, [inp(prompt=(1,), output=[3], repetition_penalty=2.0,
                                       temperature=1.0, seed=None)])
    # 1 (seen in the prompt) 4 -> 2; 3 (seen in the output) -1 -> -2; 2 and 4 unseen
    want = logits.clone()
    want[0, 1], want[0, 3] = 2.0, -2.0
    assert torch.allclose(probs, torch.softmax(want, -1), atol=1e-6)
    assert greedy(logits, inp(prompt=(1,), repetition_penalty=2.0, temperature=0)) == 2


def test_min_tokens_holds_back_eos_and_stop_token_ids_until_reached() -> None:
    logits = row(EOS, second=11)
    held = inp(temperature=0, min_tokens=3, stop_token_ids=[11])
    held.output_token_ids = [20]
    assert greedy(logits, held) not in (EOS, 11)
    held.output_token_ids = [20, 21, 22]  # reached: the model may end
    assert greedy(logits, held) == EOS
    # ignore_eos: EOS is no end, so min_tokens does not hold it back (it is just a token)
    assert greedy(logits, inp(temperature=0, min_tokens=3, ignore_eos=True)) == EOS


def test_min_p_one_at_temperature_two_draws_only_the_greedy_token() -> None:
    logits = row(3, second=9)  # at temperature 2, token 9 has 0.61 of token 3's probability
    draws = {Sampler([EOS])(logits, [inp(seed=s, temperature=2.0)])[0].token_id
             for s in range(200)}
    assert len(draws) > 1  # without min_p the draws spread
    draws = {Sampler([EOS])(logits, [inp(seed=s, temperature=2.0, min_p=1.0)])[0].token_id
             for s in range(200)}
    assert draws == {3}


def test_min_p_keeps_exactly_the_tokens_within_its_share_of_the_best() -> None:
    logits = row(3, second=9)
    t = 2.0
    ratio = math.exp((4.0 - 5.0) / t)  # p(9) / p(3)
    for min_p, kept in ((ratio - 0.01, {3, 9}), (ratio + 0.01, {3})):
        p = Sampler([EOS]).probs(logits, [inp(temperature=t, min_p=min_p, seed=None)])
        assert set(torch.nonzero(p[0]).flatten().tolist()) == kept


def test_probs_and_draws_agree_for_speculative_acceptance() -> None:
    """probs() is what acceptance compares: the same adjustments as a draw, so speculation with
    these controls stays lossless (a greedy row's p is one-hot at its adjusted argmax)."""
    logits = row(3, second=9)
    x = inp(temperature=0, logit_bias=[(3, -100.0)], seed=None)
    p = Sampler([EOS]).probs(logits, [x])
    assert p[0].argmax().item() == 9 == greedy(logits, x) and p[0].sum().item() == 1.0


@pytest.mark.parametrize("params, adjusted", [
    ({}, False), ({"temperature": 0.5, "top_k": 3, "top_p": 0.9}, False),
    ({"logit_bias": [(1, 2.0)]}, True), ({"repetition_penalty": 1.1}, True),
    ({"min_tokens": 1}, True), ({"min_p": 0.1}, True), ({"presence_penalty": 0.5}, True),
])
def test_adjusts_logits_names_every_control_that_changes_the_distribution(
        params: dict, adjusted: bool) -> None:
    assert adjusts_logits(SamplingParams(**params)) is adjusted


def test_min_tokens_yields_to_a_grammar_that_allows_only_the_end() -> None:
    """A finished grammar allows only EOS, which min_tokens holds back: the row would be all
    -inf (argmax 0, a NaN draw). The grammar wins: the end is drawn."""
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, EOS] = True
    for params in ({"temperature": 0}, {"temperature": 1.0}):
        x = inp(min_tokens=5, **params)
        assert Sampler([EOS])(row(3), [x], allowed)[0].token_id == EOS
    # while the grammar allows more than the end, min_tokens still holds it back
    allowed[0, 9] = True
    assert Sampler([EOS])(row(EOS), [inp(temperature=0, min_tokens=5)], allowed)[0].token_id == 9
