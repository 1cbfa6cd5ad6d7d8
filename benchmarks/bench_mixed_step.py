"""What prompt rows add to a step beside decoders: the runner's step time with D decode rows and
0..N prompt rows (a chunk of one more sequence's prompt), as the scheduler mixes them.

    python benchmarks/bench_mixed_step.py [MODEL] [--decoders 1,15] [--prompt-rows 0,4,16,64]
        [--context 140] [--rounds 6]

Data flow: the runner is built as the worker builds it; D sequences are prefilled with random
prompts of --context tokens, then each round runs one step per --prompt-rows value: D one-token
decodes (positions advancing) plus, when the value is > 0, that many rows of another prompt
from its start (its K/V rewritten each time). Medians and minima of --rounds per value.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_worker.model_runner import ModelRunner  # noqa: E402
from engine_worker.runner_config import AUTO, RunnerConfig  # noqa: E402
from engine_worker.step import StepItem  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="default")
    ap.add_argument("--decoders", default="1,15")
    ap.add_argument("--prompt-rows", default="0,1,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=140)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    counts = [int(v) for v in args.prompt_rows.split(",")]
    for d in (int(v) for v in args.decoders.split(",")):
        runner = ModelRunner(RunnerConfig.from_settings(
            args.model, kv_cache_mb=1024, dense_min_rows=AUTO, max_num_seqs=max(32, d + 1),
            max_num_batched_tokens=max(512, max(counts) + d)))
        ctx = args.context
        span = ctx + args.rounds * len(counts) + 8
        nblk = -(-max(span, max(counts)) // runner.block_size)
        tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(d + 1)]
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, 30000, (d + 1, max(ctx, max(counts))), generator=g).tolist()
        for i in range(d):
            runner.execute([StepItem(prompts[i][:ctx], 0, tables[i])])
        pos = ctx
        times: dict[int, list[float]] = {k: [] for k in counts}
        for _ in range(args.rounds + 1):  # the first round warms every shape
            for k in counts:
                items = [StepItem([1000 + i], pos, tables[i]) for i in range(d)]
                if k:
                    items.append(StepItem(prompts[d][:k], 0, tables[d]))
                t0 = time.perf_counter()
                runner.execute(items)
                times[k].append(time.perf_counter() - t0)
                pos += 1
        print(f"{args.model}: {d} decoders at context ~{ctx}; {runner.plan.describe()}")
        for k in counts:
            v = times[k][1:]  # the warm-up round dropped
            print(f"  + {k:4d} prompt rows: median {statistics.median(v) * 1e3:7.1f} ms, "
                  f"min {min(v) * 1e3:7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
