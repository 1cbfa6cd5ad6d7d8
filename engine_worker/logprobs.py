"""Raw logprobs: log_softmax of the model's own logits, before penalties, temperature and
top-k/top-p (the documented choice, see sampler.py), for plain and speculative steps.

    Sampler -> with_logprobs(tokens, raw_lp, rows, inputs)     one token per row
    Engine  -> logprob_entries(logits rows, emitted tokens, k)  a verify chunk's emitted tokens
"""

from __future__ import annotations

import torch

from engine_worker.step import SampleResult, SamplerInput


def with_logprobs(
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


def logprob_entries(logits: torch.Tensor, tokens: list[int], k: int) -> list[list]:
    """Raw logprobs (log_softmax of the model's logits) of `tokens`, row j scoring tokens[j]:
    one [token_id, logprob, [[top_id, top_logprob], ...k best]] entry per token."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (T, V)
    ids = torch.tensor(tokens, device=lp.device)  # (T,)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()  # (T,)
    top_vals, top_idx = torch.topk(lp, min(k, lp.shape[1]), dim=-1)  # (T, K) (T, K)
    return [[t, c, [list(x) for x in zip(i, v, strict=True)]]
            for t, c, i, v in zip(tokens, chosen, top_idx.tolist(), top_vals.tolist(),
                                  strict=True)]
