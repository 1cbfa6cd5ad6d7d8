"""Few-row matmuls over Q8_0 weights: our C++ kernel against torch's per-group INT8 kernel and a
bfloat16 copy, at the SmolLM2 LM head's shape (49152 x 576) and a layer's (3072 x 576).

    python -m benchmarks.bench_group_gemv [--rows 1,2,3] [--threads 2] [--reps 30]

Data flow: random int8 codes and float32 scales per group of 32 -> one Int8GroupLinear in each
layout (native row-major, torch group-major) and a bfloat16 matrix of the same weights -> for
each row count, the three are timed in turn, `--rounds` times interleaved (machine load hits all
alike), each time the best of `--reps` calls; the median of those bests is printed, with the
bytes each reads per call and the rate that implies.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from engine_worker.config import cache_dir_from_env
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model.quant_group import Int8GroupLinear, load_group_gemv


def best_us(fn: object, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache = cache_dir_from_env()
    why = load_group_gemv(cache)
    if why is not None:
        print(f"group_gemv kernel unavailable: {why}")
        return 1
    g = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}; best of {args.reps} calls, median of {args.rounds} rounds")
    for n, k in ((49152, 576), (3072, 576)):
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        scales = torch.rand(n, k // 32, generator=g) / 50
        routes = MatmulPlan(native_q8=True).routes("int8_groups", True)
        native = Int8GroupLinear(codes, scales, routes)
        grouped = Int8GroupLinear(codes, scales, MatmulPlan().routes("int8_groups", True))
        dense = native.dequantize(torch.bfloat16)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            calls = {"native": partial(native, x), "torch per-group": partial(grouped, x),
                     "bf16": partial(F.linear, x.to(torch.bfloat16), dense)}
            runs: dict[str, list[float]] = {name: [] for name in calls}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for name, call in calls.items():
                        runs[name].append(best_us(call, args.reps))
            med = {name: statistics.median(v) for name, v in runs.items()}
            line = ", ".join(f"{name} {us:,.0f} us" for name, us in med.items())
            gbs = (n * k * (1 + 4 / 32)) / med["native"] / 1e3
            ratio = med["torch per-group"] / med["native"]
            print(f"{n}x{k}, {m} row(s): {line}; native {ratio:.2f}x torch, reads "
                  f"{gbs:.1f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
