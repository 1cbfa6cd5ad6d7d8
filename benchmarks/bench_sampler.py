"""Sampler cost per step at 16 streams: greedy, and temperature 0.7 / top_p 0.9, on SmolLM2's
real next-token logits (a random-logits row would have an unrealistically wide nucleus).

    python benchmarks/bench_sampler.py [--model default] [--rows 16] [--steps 200] [--threads 1]

Prints ms per step for the candidate sampler (engine_worker/sampler.py) and for the previous
full-vocabulary float64 draw, reimplemented here as the reference.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine_worker.config import cache_dir_from_env
from engine_worker.model.loader import resolve_checkpoint
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.sampler import Sampler, make_generator
from engine_worker.step import SamplerInput
from protocol.messages import SamplingParams


def full_vocab_draw(logits: torch.Tensor, temperature: float, top_p: float,
                    gens: list[torch.Generator]) -> torch.Tensor:
    """The old path: top-p over the best 1024 scattered back into a (B, V) row, then a float64
    softmax and CDF over the whole vocabulary."""
    z = logits / temperature  # (B, V)
    vals, idx = torch.topk(z, 1024, dim=-1)  # (B, W)
    probs = torch.exp(vals - torch.logsumexp(z, -1, keepdim=True))  # (B, W)
    keep = (torch.cumsum(probs, -1) - probs) < top_p
    keep[:, 0] = True
    vals = vals.masked_fill(~keep, float("-inf"))
    z = torch.full_like(z, float("-inf")).scatter_(1, idx, vals)  # (B, V)
    cdf = torch.softmax(z, dim=-1, dtype=torch.float64).cumsum_(dim=-1)  # (B, V)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])
    return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = cache_dir_from_env()
    runner = ModelRunner(RunnerConfig.from_settings(args.model, dtype="float32", kv_cache_mb=64,
                                                    cache_dir=str(cache)))
    # Real text, so the next-token distributions are a served model's, not a random prompt's.
    from benchmarks.bench_speculative import TEXT, chat_ids

    ids = chat_ids(resolve_checkpoint(args.model, cache), TEXT)
    logits = runner.forward_full(ids)[-args.rows :].contiguous()  # (rows, V) real next-token
    sampler = Sampler()

    def timed(fn: object) -> float:
        for _ in range(5):
            fn()  # type: ignore[operator]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            fn()  # type: ignore[operator]
        return (time.perf_counter() - t0) / args.steps * 1e3

    greedy = [SamplerInput(SamplingParams(temperature=0.0), [], None) for _ in range(args.rows)]
    nucleus = [SamplerInput(SamplingParams(temperature=0.7, top_p=0.9), [], make_generator(i))
               for i in range(args.rows)]
    gens = [make_generator(i) for i in range(args.rows)]
    print(f"{args.rows} rows, vocab {logits.shape[1]}, torch threads {torch.get_num_threads()}")
    print(f"greedy                          {timed(lambda: sampler(logits, greedy)):6.2f} ms")
    print(f"t=0.7 top_p=0.9 candidates      {timed(lambda: sampler(logits, nucleus)):6.2f} ms")
    print(f"t=0.7 top_p=0.9 full-vocab f64  "
          f"{timed(lambda: full_vocab_draw(logits, 0.7, 0.9, gens)):6.2f} ms")


if __name__ == "__main__":
    main()
