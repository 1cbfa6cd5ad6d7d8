"""The integer-dot kernels (engine_worker/int_dot.py) against torch's current paths, at
SmolLM2-135M's layer shapes, for GGUF Q4_0, Q4_1 and Q8_0 weights.

    python -m benchmarks.bench_int_dot [--rows 1,4,16] [--threads 2] [--formats q4_0,q4_1,q8_0]

Data flow: random float weights per layer shape -> GGUF blocks (the `gguf` package's quantize)
-> the same weights in each path's layout:
  int_dot      our kernel: x quantized to Q8 per call, weights repacked 8 rows a block
  f32          F.linear with a float32 copy of the dequantized weights (the reference path)
  bf16         F.linear with a bfloat16 copy (the dense copy used from a few rows; slow on CPUs
               without native BF16)
  torch int4   _weight_int4pack_mm_for_cpu, bfloat16 activations (Q4_0 / Q4_1 layers today)
  torch int8   one _weight_int8pack_mm per group of 32 (Q8_0 without our C++ kernel)
  q8_group_mm  our older float Q8_0 kernel (csrc/group_gemv.cpp; up to 8 rows)
-> for each row count, the paths are timed in turn, `--rounds` times interleaved (machine load
hits all alike), each time the best of `--reps` calls; the median of those bests is printed in
microseconds, with int_dot's speedup over the fastest other path.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from engine_worker import int_dot
from engine_worker.config import cache_dir_from_env
from engine_worker.kernel_build import KernelUnavailable, load_kernel

Q = gguf.GGMLQuantizationType
QTYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}
# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads of 64 and 3 KV heads
LAYERS = (("q|k|v", 960, 576), ("o", 576, 576), ("gate|up", 3072, 576), ("down", 576, 1536))
INT4_PACK = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
INT4_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
INT8_MM = getattr(torch, "_weight_int8pack_mm", None)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def best_us(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def torch_paths(fmt: str, raw: np.ndarray, n: int, k: int, w: torch.Tensor,
                group_gemv: bool) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """torch's ways to compute x @ w^T for these GGUF blocks, each taking x (M, K) float32."""
    w_bf16 = w.to(torch.bfloat16)
    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "f32": lambda x: F.linear(x, w),
        "bf16": lambda x: F.linear(x.to(torch.bfloat16), w_bf16).float(),
    }
    blocks = torch.from_numpy(raw).view(n, k // 32, int_dot.BLOCK_BYTES[fmt])
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0].float()  # (N, K/32)
    if fmt != "q8_0" and INT4_PACK is not None and INT4_MM is not None and n % 16 == 0:
        nib = blocks[..., 4:] if fmt == "q4_1" else blocks[..., 2:]
        q = torch.cat([nib & 0x0F, nib >> 4], -1).reshape(n, k).to(torch.int32)
        # w = (q - 8) * scale + zero, the layout torch's int4 kernel reads
        zero = torch.zeros_like(d)
        if fmt == "q4_1":
            zero = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float() + 8 * d
        packed = INT4_PACK(q, 1)
        sz = torch.stack((d, zero), -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        paths["torch int4"] = lambda x: INT4_MM(x.to(torch.bfloat16), packed, 32, sz).float()
    if fmt == "q8_0":
        codes = blocks[..., 2:].contiguous().view(torch.int8)  # (N, K/32, 32)
        if INT8_MM is not None:
            cg = codes.transpose(0, 1).contiguous()  # (K/32, N, 32)
            sg = d.t().contiguous().to(torch.bfloat16)  # (K/32, N)

            def int8_groups(x: torch.Tensor) -> torch.Tensor:
                xg = x.to(torch.bfloat16).view(x.shape[0], -1, 32).transpose(0, 1).contiguous()
                acc = torch.zeros(x.shape[0], n)
                for g in range(xg.shape[0]):
                    acc += INT8_MM(xg[g], cg[g], sg[g])
                return acc

            paths["torch int8"] = int8_groups
        if group_gemv:
            flat = codes.reshape(n, k)
            paths["q8_group_mm"] = lambda x: (
                torch.ops.kestrel.q8_group_mm(x, flat, d) if x.shape[0] <= 8 else None)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default=",".join(int_dot.FORMATS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache = cache_dir_from_env()
    try:
        int_dot.load(cache)
    except KernelUnavailable as e:
        print(f"int_dot kernel unavailable: {e}")
        return 1
    try:
        load_kernel("group_gemv", str(cache), "q8_group_mm")
        group_gemv = True
    except KernelUnavailable:
        group_gemv = False
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{cpu_model()}; int_dot path {int_dot.isa()}; torch {torch.__version__}, "
          f"{args.threads} threads; best of {args.reps} calls, median of {args.rounds} rounds; "
          "microseconds per call")
    header = f"{'layer':<8} {'N x K':>11} {'fmt':<5} {'M':>3}"
    rng = np.random.default_rng(0)
    for fmt in args.formats.split(","):
        for name, n, k in LAYERS:
            raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05,
                                       QTYPES[fmt])
            w = int_dot.dequantize(fmt, raw, n, k).float()
            packed = int_dot.pack(fmt, raw, n, k)
            paths = {"int_dot": lambda x, p=packed: int_dot.mm(p, x),
                     **torch_paths(fmt, raw, n, k, w, group_gemv)}
            if name == LAYERS[0][0]:
                print("\n" + header + "".join(f" {p:>12}" for p in paths) + "   vs best other")
            for m in rows:
                x = torch.randn(m, k)
                live = {p: f for p, f in paths.items() if f(x) is not None}
                times: dict[str, list[float]] = {p: [] for p in live}
                for _ in range(args.rounds):
                    for p, f in live.items():
                        times[p].append(best_us(lambda f=f, x=x: f(x), args.reps))
                med = {p: statistics.median(t) for p, t in times.items()}
                other_best = min(v for p, v in med.items() if p != "int_dot")
                cells = "".join(f" {med[p]:>12.1f}" if p in med else f" {'-':>12}"
                                for p in paths)
                print(f"{name:<8} {f'{n} x {k}':>11} {fmt:<5} {m:>3}{cells}"
                      f"   {other_best / med['int_dot']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
