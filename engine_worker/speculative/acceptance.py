"""Lossless speculative acceptance (rejection sampling), vectorised over sequences.

For one sequence with drafts d_1..d_n drawn from draft distributions q_1..q_n, and the target's
fully processed distributions p_0..p_n (p_i scores the position after d_i; p_0 the position after
the last committed token):

    for i in 1..n: accept d_i with probability min(1, p_{i-1}[d_i] / q_i[d_i])
    at the first rejection r: emit one token from normalize(max(0, p_{r-1} - q_r)), stop
    all n accepted: emit a bonus token from p_n

Every emitted token is then distributed exactly as the target would have sampled it (Leviathan
et al. 2023; Chen et al. 2023). Greedy targets are one-hot p: a draft passes iff it is the argmax,
and the replacement is the argmax, so the same code serves them with u = 0 and no RNG. A proposer
without probabilities (n-gram lookup) is a one-hot q at its draft.

Shapes: N sequences, K = the most drafts any of them carries, V the vocabulary. A sequence with
fewer drafts pads its rows; positions past its own count are never accepted.
"""

from __future__ import annotations

import torch


def accept(
    p: torch.Tensor,
    q: torch.Tensor | None,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for N sequences at once.

    p: (N, K + 1, V) target probabilities; q: (N, K, V) draft probabilities, or None for one-hot
    drafts; drafts: (N, K) int64; num_drafts: (N,) int64 in 0..K; u: (N, K + 1) uniforms in [0, 1)
    (the first K decide acceptance, the last draws the final token; zeros for greedy rows).
    Returns (num_accepted (N,), final token (N,)): the emitted tokens of row i are
    drafts[i, :num_accepted[i]] followed by final[i].
    """
    n, k1, vocab = p.shape
    k = k1 - 1
    rows = torch.arange(n, device=p.device)  # (N,)
    if k > 0:
        pd = p[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # (N, K) p_{i-1}[d_i]
        qd = torch.ones_like(pd) if q is None else q.gather(2, drafts.unsqueeze(2)).squeeze(2)
        # u < p / q, written without a division (q[d] > 0 for a drawn draft).
        ok = u[:, :k] * qd < pd  # (N, K)
        ok &= torch.arange(k, device=p.device) < num_drafts.unsqueeze(1)
        accepted = ok.long().cumprod(1).sum(1)  # (N,) leading run of acceptances
    else:
        accepted = torch.zeros(n, dtype=torch.long, device=p.device)
    p_last = p[rows, accepted]  # (N, V) the position the final token is drawn for
    resid = p_last
    rejected = accepted < num_drafts  # (N,)
    if k > 0 and bool(rejected.any()):
        at = accepted.clamp_max(k - 1)  # (N,) the rejected draft's index (valid where rejected)
        if q is None:
            q_r = torch.zeros_like(p_last).scatter_(1, drafts[rows, at].unsqueeze(1), 1.0)
        else:
            q_r = q[rows, at]  # (N, V)
        diff = (p_last - q_r).clamp_min(0.0)  # (N, V)
        # p == q leaves nothing (a rejection then has probability 0): fall back to p itself.
        usable = rejected & (diff.sum(1) > 0)
        resid = torch.where(usable.unsqueeze(1), diff, p_last)
    cdf = resid.double().cumsum(1)  # (N, V)
    target = (u[:, k].double() * cdf[:, -1]).unsqueeze(1)  # (N, 1)
    final = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(vocab - 1)  # (N,)
    return accepted, final
