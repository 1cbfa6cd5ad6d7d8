"""Greedy decode throughput of the model runner alone (no engine, no sampler): execute() calls.

    python benchmarks/bench_runner.py [MODEL] [--batch 1,16] [--prompt 128] [--steps 128]
        [--dtype auto] [--quantization none] [--threads N] [--dense-min-rows -1] [--compile off]

Data flow: the runner is built as the worker builds it (RunnerConfig.from_settings with these
flags); per batch size, one prefill of random prompts, then --steps one-token decodes of the
argmax, timed. Was `python -m engine_worker.model_runner` before issue 24.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_worker.config import COMPILE_MODES  # noqa: E402
from engine_worker.model_runner import ModelRunner  # noqa: E402
from engine_worker.runner_config import AUTO, RunnerConfig  # noqa: E402
from engine_worker.step import StepItem  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False,
                                 description="Greedy decode throughput through execute().")
    ap.add_argument("model", nargs="?", default="default")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dense-min-rows", type=int, default=AUTO,
                    help="GGUF-native: a copy from this many rows (0: none; -1: measured)")
    ap.add_argument("--compile", default="off", choices=COMPILE_MODES,
                    help="decode: compiled one-token steps (benchmarks/bench_compiled_decode.py "
                         "compares them with eager side by side)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.batch.split(",")]
    runner = ModelRunner(RunnerConfig.from_settings(
        args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
        kv_cache_mb=1024, threads=args.threads, dense_min_rows=args.dense_min_rows,
        compile=args.compile, max_num_seqs=max(sizes), max_num_batched_tokens=max(512, *sizes)))
    nblk = -(-(args.prompt + args.steps) // runner.block_size)
    for b in sizes:
        tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(b)]
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, 40000, (b, args.prompt), generator=g).tolist()
        t0 = time.perf_counter()
        toks = runner.execute([StepItem(prompts[i], 0, tables[i]) for i in range(b)]).argmax(-1)
        prefill = time.perf_counter() - t0
        if runner.compiled is not None:  # compile (or load) this batch's graphs untimed
            ctx = range(args.prompt + 1, args.prompt + args.steps + 1)
            runner.compiled.warm({runner.compiled.bucket(b, -(-n // runner.block_size))
                                  for n in ctx})
        t0 = time.perf_counter()
        for s in range(args.steps):
            items = [StepItem([int(toks[i])], args.prompt + s, tables[i]) for i in range(b)]
            toks = runner.execute(items).argmax(-1)
        dt = time.perf_counter() - t0
        print(
            f"{args.dtype}/{args.quantization}/compile {args.compile} batch {b}: prefill "
            f"{b}x{args.prompt} {prefill * 1e3:.0f} ms, decode "
            f"{dt / args.steps * 1e3:.1f} ms/step, {b * args.steps / dt:.1f} tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
