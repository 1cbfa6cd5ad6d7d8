"""The integer-dot kernel with its weights streamed from memory, as a decode step reads them: a
model's layer shapes, `--layers` distinct copies (so no layer is still in cache when it comes
round again), timed at a few row counts.

    python benchmarks/bench_int_dot_stream.py [--rows 1,16] [--fmt q4_1] [--layers 28]
        [--shapes 2048x1536,1536x1536,17920x1536,1536x8960] [--threads 2]

Data flow: random GGUF blocks of `--fmt` (scales set to finite values) per shape and layer ->
int_dot.pack -> for each row count, `--passes` passes over every layer's matmuls in order, each
timed; the best pass after the first is printed with GMAC/s and GB/s of packed weights read.
The default shapes are Qwen2.5-Coder-1.5B's (hidden 1536, 8960, q|k|v 2048, gate|up 17920);
bench_int_dot.py times SmolLM2's shapes with the weights in cache, against torch's paths.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_worker import int_dot  # noqa: E402


def blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if fmt in int_dot.SUPER_BYTES:  # K-quant super-blocks: their fp16 scales made finite
        raw = rng.integers(0, 256, size=(n, k // 256, int_dot.SUPER_BYTES[fmt]), dtype=np.uint8)
        at = (208,) if fmt == "q6_k" else (0, 2)
        for a in at:
            raw[..., a:a + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        return raw.reshape(n, -1)
    raw = rng.integers(0, 256, size=(n, k // 32, int_dot.BLOCK_BYTES[fmt]), dtype=np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
    if fmt in ("q4_1", "q8_1", "q6_16", "q8_16"):
        raw[..., 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
    return raw.reshape(n, -1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--fmt", default="q4_1", choices=int_dot.FORMATS)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--shapes", default="2048x1536,1536x1536,17920x1536,1536x8960")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    int_dot.load()
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    layers = [[int_dot.pack(args.fmt, blocks(args.fmt, n, k, rng), n, k) for n, k in shapes]
              for _ in range(args.layers)]
    read = sum(t.numel() * t.element_size() for layer in layers for p in layer
               for t in (p.qs, p.d, p.m) if t is not None)
    print(f"{args.fmt}, {args.layers} layers of {args.shapes}, {read / 2**20:.0f} MiB packed; "
          f"int_dot path {int_dot.isa()}, {args.threads} threads", flush=True)
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for _, k in shapes}
        times = []
        for _ in range(args.passes):
            t0 = time.perf_counter()
            for layer in layers:
                for p in layer:
                    int_dot.mm(p, xs[p.k])
            times.append(time.perf_counter() - t0)
        best = min(times[1:])
        macs = m * args.layers * sum(n * k for n, k in shapes)
        print(f"rows {m:4d}: {best * 1e3:7.1f} ms a pass, {macs / best / 1e9:6.1f} GMAC/s, "
              f"{read / best / 1e9:5.1f} GB/s of weights", flush=True)


if __name__ == "__main__":
    main()
