"""The paged decode attention kernel over one sequence, by the KV cache's dtype (issue 53).

    python benchmarks/bench_attention_kv_dtype.py [--contexts 128,2500,8192] [--layers 28]
        [--heads 12 --kv-heads 2 --head-dim 128] [--threads 2]

Data flow: for each context and each cache dtype (float32, bfloat16, float16), `--layers`
distinct caches of random K and V (so a layer's context is not still in cache when it comes round
again) and one float32 query row per head -> `paged_decode_attention` once per layer, as one
decode step of one stream calls it; the best of 20 such passes is printed in ms. The defaults are
Qwen2.5-Coder-1.5B's attention (12 query heads, 2 KV heads of 128, 28 layers). Beside the bytes
each pass reads (K and V of every layer), it says whether the kernel is bound by them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_worker.config import default_cache_dir  # noqa: E402
from engine_worker.paged_attention import (  # noqa: E402
    load_paged_attention,
    paged_decode_attention,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,2500,8192")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pa = load_paged_attention("auto", torch.device("cpu"), torch.float32,
                              Path(default_cache_dir()))
    if not pa.enabled:
        raise SystemExit(f"the kernel is not available here: {pa.reason}")
    h, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, 16
    print("| context | cache | ms a step (all layers) | MB read | GB/s |")
    print("|---:|---|---:|---:|---:|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        nblk = -(-ctx // bs)
        table, lens = torch.arange(nblk).view(1, nblk), torch.tensor([ctx])
        q = torch.randn(1, h, d)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            ks = [torch.randn(hkv, nblk * bs, d).to(dtype) for _ in range(args.layers)]
            vs = [torch.randn(hkv, nblk * bs, d).to(dtype) for _ in range(args.layers)]
            best = float("inf")
            for _ in range(20):
                t = time.perf_counter()
                for k, v in zip(ks, vs, strict=True):
                    paged_decode_attention(q, k, v, table, lens, bs)
                best = min(best, time.perf_counter() - t)
            read = 2 * args.layers * ctx * hkv * d * ks[0].element_size()
            print(f"| {ctx} | {str(dtype).removeprefix('torch.')} | {1e3 * best:.2f} | "
                  f"{read / 1e6:.0f} | {read / best / 1e9:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
