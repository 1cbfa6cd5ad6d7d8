"""The candidate sampler (top-k/top-p candidates only) against a full-vocabulary reference.

The reference is the sampler as it was: float64 softmax and CDF over the whole vocabulary with
removed tokens at -inf. The candidate path must give the same distribution (seeded statistical
test), the same dense probabilities (`Sampler.probs`), and the same greedy tokens.
"""

from __future__ import annotations

import torch

from engine_worker.sampler import Sampler, make_generator
from engine_worker.step import SamplerInput
from protocol.messages import SamplingParams

V = 500


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Full-vocabulary float64 distribution: temperature, top-k, then top-p by a full sort."""
    z = logits.double() / p.temperature  # (V,)
    if 0 < p.top_k < z.numel():
        kth = torch.topk(z, p.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, -1)  # (V,)
    if p.top_p < 1.0:
        sp, order = torch.sort(probs, descending=True)
        before = sp.cumsum(-1) - sp
        keep = before < p.top_p
        keep[0] = True
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, order, keep)
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


CASES = [
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_k=50),
    dict(temperature=1.3, top_k=300, top_p=0.8),
    dict(temperature=1.0),
]


def test_dense_probs_equal_full_reference() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(CASES), V, generator=g) * 4  # (B, V)
    inputs = [SamplerInput(SamplingParams(**c), [], make_generator(1)) for c in CASES]
    got = Sampler().probs(logits, inputs)  # (B, V)
    for i, c in enumerate(CASES):
        ref = reference_probs(logits[i], SamplingParams(**c)).float()
        assert torch.allclose(got[i], ref, atol=1e-6), c


def test_candidate_draws_follow_full_distribution() -> None:
    """100 seeded streams x 60 steps per case; total-variation distance to the reference."""
    g = torch.Generator().manual_seed(5)
    rows, steps = 100, 60
    sampler = Sampler()
    for case in CASES:
        params = SamplingParams(**case)
        row = torch.randn(V, generator=g) * 3  # (V,)
        ref = reference_probs(row, params)
        logits = row.expand(rows, V)  # (rows, V)
        inputs = [SamplerInput(params, [], make_generator(100 + r)) for r in range(rows)]
        counts = torch.zeros(V, dtype=torch.float64)
        for _ in range(steps):
            for res in sampler(logits, inputs):
                counts[res.token_id] += 1
        assert counts[ref == 0].sum() == 0, "a removed token was drawn"
        emp = counts / counts.sum()
        # Support of the flat case is V tokens: noise ~ 0.5 * sqrt(V_eff / N).
        support = int((ref > 0).sum())
        bound = 0.6 * (support / (rows * steps)) ** 0.5 + 0.01
        tv = 0.5 * float((emp - ref).abs().sum())
        assert tv < bound, (case, tv, bound)


def test_greedy_tokens_unchanged() -> None:
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(16, 49152, generator=g)  # (16, V)
    inputs = [SamplerInput(SamplingParams(temperature=0.0), [], None) for _ in range(16)]
    out = Sampler()(logits, inputs)
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()
    dense = Sampler().probs(logits, inputs)
    assert dense.argmax(-1).tolist() == logits.argmax(-1).tolist()
    assert torch.equal(dense.sum(-1), torch.ones(16))
