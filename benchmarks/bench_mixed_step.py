"""What prompt rows add to a step beside decoders: the runner's step time with D decode rows and
0..N prompt rows (a chunk of one more sequence's prompt), as the scheduler mixes them.

    python benchmarks/bench_mixed_step.py [MODEL] [--decoders 1,15] [--prompt-rows 0,4,16,64]
        [--context 140] [--prompt-start 0] [--rounds 6] [--both-ways]

Data flow: the runner is built as the worker builds it; D sequences are prefilled with random
prompts of --context tokens, then each round runs one step per --prompt-rows value: D one-token
decodes (positions advancing) plus, when the value is > 0, that many rows of another prompt
from --prompt-start (its earlier tokens prefilled once; its chunk's K/V rewritten each time).
Medians and minima of --rounds per value. --both-ways times each step twice, alternating: the
prompt chunk through the decode stack as decode rows (the runner's choice where it makes it,
ModelRunner._prompts_as_decodes) and through the Python layers (prompts_through_stack off).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_worker import model_runner  # noqa: E402
from engine_worker.model_runner import ModelRunner  # noqa: E402
from engine_worker.runner_config import AUTO, RunnerConfig  # noqa: E402
from engine_worker.step import StepItem  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="default")
    ap.add_argument("--decoders", default="1,15")
    ap.add_argument("--prompt-rows", default="0,1,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=140)
    ap.add_argument("--prompt-start", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--both-ways", action="store_true")
    args = ap.parse_args(argv)
    ways = (True, False) if args.both_ways else (True,)
    if args.both_ways:  # as decode rows whatever the chunk's context: the choice's two sides
        model_runner.PROMPT_AS_DECODES_READS = 1 << 62
    counts = [int(v) for v in args.prompt_rows.split(",")]
    for d in (int(v) for v in args.decoders.split(",")):
        runner = ModelRunner(RunnerConfig.from_settings(
            args.model, kv_cache_mb=1024, dense_min_rows=AUTO, max_num_seqs=max(32, d + 1),
            max_num_batched_tokens=max(512, max(counts) + d)))
        ctx = args.context
        start = args.prompt_start
        span = ctx + (args.rounds + 1) * len(counts) * len(ways) + 8
        nblk = -(-max(span, start + max(counts)) // runner.block_size)
        tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(d + 1)]
        g = torch.Generator().manual_seed(0)
        longest = max(ctx, start + max(counts))
        prompts = torch.randint(100, 30000, (d + 1, longest), generator=g).tolist()
        for i in range(d):
            runner.execute([StepItem(prompts[i][:ctx], 0, tables[i])])
        if start:
            runner.execute([StepItem(prompts[d][:start], 0, tables[d])])
        pos = ctx
        times: dict[tuple[int, bool], list[float]] = {(k, w): [] for k in counts for w in ways}
        for _ in range(args.rounds + 1):  # the first round warms every shape
            for k in counts:
                for way in ways:
                    runner.prompts_through_stack = way
                    items = [StepItem([1000 + i], pos, tables[i]) for i in range(d)]
                    if k:
                        items.append(StepItem(prompts[d][start:start + k], start, tables[d]))
                    t0 = time.perf_counter()
                    runner.execute(items)
                    times[k, way].append(time.perf_counter() - t0)
                    pos += 1
        print(f"{args.model}: {d} decoders at context ~{ctx}, prompt rows from position "
              f"{start}; {runner.plan.describe()}")
        for k in counts:
            for way in ways:
                v = times[k, way][1:]  # the warm-up round dropped
                how = "" if len(ways) == 1 else (
                    " stack as decodes" if way else " Python layers    ")
                print(f"  + {k:4d} prompt rows{how}: median {statistics.median(v) * 1e3:7.1f} "
                      f"ms, min {min(v) * 1e3:7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
