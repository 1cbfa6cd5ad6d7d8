"""Decode-step time with the grouped (per KV head) decode attention vs the enable_gqa path.

Data flow: one ModelRunner loads the model; B sequences with ragged prompts are prefilled into
scattered (non-consecutive) blocks, so every decode reads its context through the block-table
gather; then decode steps of all B sequences alternate between the two attention paths (same
runner, same cache, interleaved rounds, so machine load hits both alike) and the median and
minimum ms per step are printed. `--profile` prints torch.profiler's top ops of one step.
Then one layer's decode attention alone (gather + SDPA, the model's head sizes, the same
scattered tables) is timed both ways, interleaved: the part this change touches, without the
matmuls whose noise swamps it on a shared machine.

    python -m benchmarks.bench_decode_attention --model ~/.cache/kestrel/<smollm2 dir> --batch 1 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem


def set_grouped(runner: ModelRunner, on: bool) -> None:
    # both on the gather path: the in-place kernel (bench_paged_attention) bypasses either
    runner.set_paged_attention(False)
    for layer in runner.model.model.layers:
        layer.self_attn.grouped_decode = on


def bench(runner: ModelRunner, batch: int, ctx: int, rounds: int, steps: int,
          profile: bool) -> None:
    bs = runner.block_size
    nblk = -(-(ctx + 64 + rounds * steps * 2) // bs)
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(batch):  # block j of sequence i is i + j*batch: never consecutive for batch>1
        table = [i + j * batch for j in range(nblk)][::-1]
        length = ctx - (i * 37) % 64  # ragged: lengths differ by up to 63
        ids = torch.randint(0, runner.config.vocab_size, (length,), generator=g).tolist()
        items.append(StepItem(ids, 0, table))
        runner.execute([items[-1]])
    pos = [len(it.token_ids) for it in items]
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for _ in range(rounds):
            for grouped in (False, True):
                set_grouped(runner, grouped)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step = [StepItem([1], p, it.block_table)
                            for p, it in zip(pos, items, strict=True)]
                    runner.execute(step)
                    pos = [p + 1 for p in pos]
                times[grouped].append((time.perf_counter() - t0) / steps * 1e3)
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as prof

            for grouped in (False, True):
                set_grouped(runner, grouped)
                with prof(activities=[ProfilerActivity.CPU]) as p:
                    runner.execute([StepItem([1], q, it.block_table)
                                    for q, it in zip(pos, items, strict=True)])
                print(f"--- grouped={grouped}")
                print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    attn = runner.model.model.layers[0].self_attn
    k_cache, v_cache = runner.kv_cache.k[0], runner.kv_cache.v[0]
    ctx_t = torch.tensor(pos)
    t_max = int(ctx_t.max())
    blocks = torch.tensor([blk for it in items for blk in it.block_table[: -(-t_max // bs)]])
    q = torch.randn(batch, attn.h, attn.d, generator=g)  # (B, H, D)
    mask = (torch.arange(t_max) < ctx_t[:, None]).view(batch, 1, 1, t_max)  # (B, 1, 1, T)
    us: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for _ in range(15):
            for grouped in (False, True):
                t0 = time.perf_counter()
                for _ in range(20):
                    kd, vd = attn._context(k_cache, v_cache, blocks, bs, batch, t_max)
                    if grouped:
                        attn._decode_grouped(q, kd, vd, mask)
                    else:
                        torch.nn.functional.scaled_dot_product_attention(
                            q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=True)
                us[grouped].append((time.perf_counter() - t0) / 20 * 1e6)
    for grouped, name in ((False, "enable_gqa"), (True, "grouped")):
        print(f"batch {batch:2d} one layer's decode attention {name:10s}: median "
              f"{statistics.median(us[grouped]):6.0f} us, min {min(us[grouped]):6.0f}")
    for grouped, name in ((False, "enable_gqa"), (True, "grouped")):
        t = times[grouped]
        print(f"batch {batch:2d} ctx ~{ctx} {name:10s}: median {statistics.median(t):6.2f} "
              f"ms/step, min {min(t):6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    runner = ModelRunner(RunnerConfig.from_settings(a.model, dtype="float32", kv_cache_mb=768))
    for b in a.batch:
        bench(runner, b, a.ctx, a.rounds, a.steps, a.profile)


if __name__ == "__main__":
    main()
