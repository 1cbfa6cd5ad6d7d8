"""Speculative acceptance is lossless: emitted tokens follow the target distribution exactly.

200,000 seeded draws at temperature 1 (p and q random dense distributions; q also one-hot at a
draft as n-gram lookup proposes), checked at positions 1 and 2 of the output by total-variation
distance to p. Vectorised: one `accept` call per round over all draws.
"""

from __future__ import annotations

import pytest
import torch

from engine_worker.speculative.acceptance import accept

N = 200_000
V = 12
K = 2


def random_dist(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, V, generator=g) * 1.5, dim=-1)  # (..., V)


def tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    emp = torch.bincount(tokens, minlength=V).double() / tokens.numel()
    return 0.5 * float((emp - p.double()).abs().sum())


@pytest.mark.parametrize("one_hot_q", [False, True])
def test_emitted_tokens_follow_target(one_hot_q: bool) -> None:
    g = torch.Generator().manual_seed(11)
    p_pos = random_dist(g, K + 1)  # (K + 1, V): target at positions 1, 2, 3 (prefix-free)
    q_pos = random_dist(g, K)  # (K, V) draft distributions
    if one_hot_q:
        # n-gram style: a fixed guess per position (one likely, one unlikely under p).
        guesses = torch.tensor([int(p_pos[0].argmax()), int(p_pos[1].argmin())])
        drafts = guesses.expand(N, K).clone()  # (N, K)
        q = None
    else:
        drafts = torch.stack(
            [torch.multinomial(q_pos[i], N, replacement=True, generator=g) for i in range(K)], 1
        )  # (N, K) drawn from q
        q = q_pos.expand(N, K, V)
    p = p_pos.expand(N, K + 1, V)
    u = torch.rand(N, K + 1, generator=g, dtype=torch.float64)
    accepted, final = accept(p, q, drafts, torch.full((N,), K), u)
    out = torch.cat([drafts, final.unsqueeze(1)], 1)  # (N, K + 1)
    first = out.gather(1, torch.zeros(N, 1, dtype=torch.long)).squeeze(1)
    first = torch.where(accepted >= 1, first, final)
    # Position 2: in the same step if d_1 passed, else from the next step's round (one draft
    # from q_2's place, here re-proposed against p_1).
    second_same = torch.where(accepted >= 2, drafts[:, 1], final)
    re_drafts = drafts[:, 1:2] if one_hot_q else torch.multinomial(
        q_pos[1], N, replacement=True, generator=g).unsqueeze(1)
    re_q = None if one_hot_q else q_pos[1:2].expand(N, 1, V)
    u2 = torch.rand(N, 2, generator=g, dtype=torch.float64)
    ones = torch.ones(N, dtype=torch.long)
    acc2, fin2 = accept(p_pos[1:3].expand(N, 2, V), re_q, re_drafts, ones, u2)
    second_next = torch.where(acc2 >= 1, re_drafts[:, 0], fin2)
    second = torch.where(accepted >= 1, second_same, second_next)
    assert tv(first, p_pos[0]) < 0.01
    assert tv(second, p_pos[1]) < 0.01
    # Not a vacuous pass: drafts were both accepted and rejected.
    assert 0.05 < accepted.double().mean() < K - 0.05


def test_greedy_accepts_while_argmax() -> None:
    p = torch.zeros(3, K + 1, V)
    best = torch.tensor([[3, 5, 7], [3, 5, 7], [3, 5, 7]])
    p.scatter_(2, best.unsqueeze(2), 1.0)  # one-hot targets
    drafts = torch.tensor([[3, 5], [3, 4], [2, 5]])
    accepted, final = accept(p, None, drafts, torch.full((3,), K), torch.zeros(3, K + 1))
    assert accepted.tolist() == [2, 1, 0]
    assert final.tolist() == [7, 5, 3]  # bonus after all; the argmax where a draft failed


def test_no_drafts_samples_target() -> None:
    p = torch.zeros(2, 1, V)
    p[:, 0, 4] = 1.0
    accepted, final = accept(p, None, torch.zeros(2, 0, dtype=torch.long),
                             torch.zeros(2, dtype=torch.long), torch.rand(2, 1))
    assert accepted.tolist() == [0, 0] and final.tolist() == [4, 4]


def test_fewer_drafts_than_width_never_accepts_padding() -> None:
    p = torch.zeros(1, K + 1, V)
    p[0, :, 1] = 1.0
    accepted, final = accept(p, None, torch.tensor([[1, 1]]), torch.tensor([1]),
                             torch.zeros(1, K + 1))
    assert accepted.tolist() == [1] and final.tolist() == [1]
