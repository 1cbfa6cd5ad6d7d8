"""Decode step time with the KV cache vs recomputing the whole sequence, across lengths.

    python benchmarks/bench_kv.py [--model default] [--lengths 64,128,256,512,1024] [--png PATH]

For each context length L: the mean time of one decode step at position L through the paged
KV cache (execute() with one new token), and of one recompute of all L tokens (forward_full).
Prints a Markdown table and draws both curves to a PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_worker.config import cache_dir_from_env  # noqa: E402
from engine_worker.model_runner import ModelRunner  # noqa: E402
from engine_worker.runner_config import RunnerConfig  # noqa: E402
from engine_worker.step import StepItem  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--lengths", default="64,128,256,512,1024")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--png", default="benchmarks/results/kv_vs_recompute.png")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = cache_dir_from_env()
    runner = ModelRunner(RunnerConfig.from_settings(args.model, dtype="float32", kv_cache_mb=512,
                                                    cache_dir=str(cache)))
    lengths = [int(x) for x in args.lengths.split(",")]
    g = torch.Generator().manual_seed(0)
    rows = []
    for length in lengths:
        ids = torch.randint(100, 40000, (length + args.repeats,), generator=g).tolist()
        table = list(range(-(-(length + args.repeats) // runner.block_size)))
        runner.execute([StepItem(ids[:length], 0, table)])  # prefill the cache
        start = time.perf_counter()
        for r in range(args.repeats):
            runner.execute([StepItem([ids[length + r]], length + r, table)])
        cached = (time.perf_counter() - start) / args.repeats
        start = time.perf_counter()
        for r in range(args.repeats):
            runner.forward_full(ids[: length + r + 1])
        full = (time.perf_counter() - start) / args.repeats
        rows.append((length, cached * 1000, full * 1000))
        print(f"| {length} | {cached * 1000:.1f} | {full * 1000:.1f} | {full / cached:.1f}x |",
              flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r[0] for r in rows], [r[1] for r in rows], "o-", label="KV cache (one new token)")
    ax.plot([r[0] for r in rows], [r[2] for r in rows], "s-", label="recompute all tokens")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("ms per decode step")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"SmolLM2-135M float32, {os.cpu_count()} CPUs")
    ax.legend()
    ax.grid(True, alpha=0.3)
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
