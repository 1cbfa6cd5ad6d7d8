"""Driving an Engine over a runner until every request is done: the greedy tokens of each, for
tests that compare two attention paths token for token."""

from __future__ import annotations

import random

from engine_worker.engine import Engine
from engine_worker.model_runner import ModelRunner
from protocol import messages as m


def greedy_tokens(runner: ModelRunner, lengths: tuple[tuple[str, int], ...], seed: int,
                  max_tokens: int = 50) -> dict[str, list[int]]:
    """Request id -> its `max_tokens` greedy tokens, for random prompts of the given lengths,
    all in one engine (continuous batching, chunked prefill of 256 tokens a step)."""
    engine = Engine(runner, max_num_seqs=8, max_num_batched_tokens=256)
    rng = random.Random(seed)
    params = m.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, n in lengths:
        engine.add(m.Generate(rid, [rng.randrange(3, 49152) for _ in range(n)], params))
    out: dict[str, list[int]] = {}
    for _ in range(500):
        if not engine.has_work:
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out
