"""What a test may expect of two compute paths on whatever CPU runs it.

Two paths that compute the same function (our forward and transformers', a C++ kernel and torch,
float32 and a quantized copy, one row alone and in a batch) round differently, and how differently
depends on the host: vector width, FMA contraction and reduction order change with the ISA
(AVX2, AVX512, VNNI, BF16). So no test here compares logits with an absolute constant tuned on
one CPU, and no test expects the same greedy token where the reference itself is nearly tied.

    logit bounds:  |ours - exact| <= max(SLACK * |peer - exact|, ULPS * eps32 * max|exact|)
                   `exact` is a float64 forward, `peer` a float32 path we trust (transformers):
                   ours may round at most a few times worse than the reference does on this host.
    greedy tokens: equal up to the first step where the reference's top two are within `margin`
                   (in nats of log-softmax); past a near tie either choice is right.
    content:       asserted only on a prefix whose every token won by at least `margin`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

EPS32 = torch.finfo(torch.float32).eps
# Ours against float64 may be this many times further off than transformers' own float32 forward.
SLACK = 8.0
# A floor on the bound in float32 units of the largest logit: a path whose rounding is already
# near-exact (tiny models, few layers) must not demand better than a few ulps of accumulation.
ULPS = 64.0
# The floor for a path that rounds activations to bfloat16: four bfloat16 steps, in float32 ulps.
BF16_ULPS = 4 * torch.finfo(torch.bfloat16).eps / EPS32
# A near tie: the reference's top two log-probabilities closer than this (nats). Differences
# between paths measured on SmolLM2 reach ~0.1 nats for the quantized ones; half a nat is far
# beyond what rounding moves and well inside what a confident token wins by (2-6 nats).
MARGIN = 0.5


def rounding_bound(exact: torch.Tensor, peer: torch.Tensor | None = None, *, slack: float = SLACK,
                   ulps: float = ULPS) -> float:
    """The largest |ours - exact| a float32 path may show: `slack` times what `peer` (another
    float32 path) shows on this host, and never below `ulps` units of the largest |exact|."""
    floor = ulps * EPS32 * exact.abs().max().item()
    if peer is None:
        return floor
    return max(floor, slack * (peer.double() - exact.double()).abs().max().item())


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """(T,) how far each row's best token leads the second, in nats of log-softmax."""
    top = logits.double().log_softmax(-1).topk(2, dim=-1).values  # (T, 2)
    return top[..., 0] - top[..., 1]


def assert_logits_close(ours: torch.Tensor, exact: torch.Tensor, peer: torch.Tensor | None = None,
                        *, slack: float = SLACK, ulps: float = ULPS) -> None:
    """`ours` (T, V) within the host's rounding of the float64 `exact`, and the same argmax
    wherever `exact` is not tied within twice that rounding."""
    assert ours.shape == exact.shape
    bound = rounding_bound(exact, peer, slack=slack, ulps=ulps)
    diff = (ours.double() - exact.double()).abs()  # (T, V)
    peer_err = "-" if peer is None else f"{(peer.double() - exact.double()).abs().max():.3g}"
    assert diff.max().item() <= bound, (
        f"max |ours - float64| {diff.max():.3g} > bound {bound:.3g} "
        f"(peer's error {peer_err}, largest logit {exact.abs().max():.3g})")
    raw_gap = exact.double().topk(2, dim=-1).values  # (T, 2) in logits, not nats
    decided = (raw_gap[..., 0] - raw_gap[..., 1]) > 2 * bound
    same = ours.argmax(-1) == exact.argmax(-1)
    assert bool(same[decided].all()), \
        f"argmax differs at decided rows {(~same & decided).nonzero().flatten().tolist()}"


def first_near_tie(gaps: Sequence[float] | torch.Tensor, margin: float = MARGIN) -> int:
    """Index of the first gap under `margin` (len(gaps) if none)."""
    for i, gap in enumerate(torch.as_tensor(gaps, dtype=torch.float64).tolist()):
        if gap < margin:
            return i
    return len(gaps)


def assert_same_greedy(ours: Sequence[int], ref: Sequence[int],
                       ref_gaps: Sequence[float] | torch.Tensor, margin: float = MARGIN,
                       min_checked: int = 1) -> int:
    """`ours` equals `ref` up to the reference's first near tie; returns how many were compared.
    `min_checked` guards the comparison from passing on nothing (a prompt tied at once)."""
    n = min(first_near_tie(ref_gaps, margin), len(ref), len(ours))
    assert n >= min_checked, f"only {n} tokens are decisive (gaps {list(ref_gaps)[:8]})"
    assert list(ours[:n]) == list(ref[:n]), (
        f"differ before any near tie (first {n} compared): {list(ours[:n])} vs {list(ref[:n])}")
    return n


def decisive_chat_text(choice: object, margin: float = MARGIN) -> str:
    """The text of an openai chat choice (asked with logprobs and top_logprobs >= 2) up to its
    first token that led the runner-up by less than `margin` nats."""
    entries = choice.logprobs.content  # type: ignore[attr-defined]
    gaps = [e.top_logprobs[0].logprob - e.top_logprobs[1].logprob for e in entries]
    return "".join(e.token for e in entries[:first_near_tie(gaps, margin)])


def decisive_completion_text(choice: object, margin: float = MARGIN) -> str:
    """The same for an openai completion choice (logprobs >= 2)."""
    lp = choice.logprobs  # type: ignore[attr-defined]
    gaps = []
    for top in lp.top_logprobs:
        best = sorted(top.values(), reverse=True)
        gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return "".join(lp.tokens[:first_near_tie(gaps, margin)])
