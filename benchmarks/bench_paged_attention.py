"""Decode attention read in place (the paged C++ kernel) vs the gather path (issue 10).

Data flow: for each --dtype (auto = the embedded SmolLM2's GGUF-native weights, float32 = the
converted checkpoint; both keep a float32 KV cache; bfloat16 a bf16 one) one ModelRunner loads
the model; B sequences with ragged prompts are prefilled into scattered (non-consecutive)
blocks. Then, interleaved round by round on the same runner and cache (so machine load hits
both alike):
  1. one layer's decode attention alone, the model's head sizes and those tables: the gather
     path (index_select of whole blocks + grouped SDPA, exactly what Attention runs) against
     the kernel; at batch 1 also the consecutive-blocks view path (no copy) against the kernel;
  2. whole decode steps through runner.execute with the kernel on and off.
Medians and minima are printed with ratios gather / kernel (> 1: the kernel is faster).

    python -m benchmarks.bench_paged_attention --dtype auto float32 --batch 1 16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from engine_worker.config import cache_dir_from_env
from engine_worker.model_runner import ModelRunner
from engine_worker.paged_attention import paged_decode_attention
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, list]:
    """Seconds per call of each fn, one sample per round, the fns alternating within a round."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out[name].append((time.perf_counter() - t0) / reps)
    return out


def report(label: str, t: dict[str, list[float]], unit: float, unit_name: str) -> None:
    names = list(t)
    for name in names:
        print(f"{label} {name:14s}: median {statistics.median(t[name]) * unit:8.2f} {unit_name}, "
              f"min {min(t[name]) * unit:8.2f}")
    base = names[0]
    for name in names[1:]:
        r_med = statistics.median(t[base]) / statistics.median(t[name])
        r_min = min(t[base]) / min(t[name])
        print(f"{label} ratio {base}/{name}: median {r_med:.2f}x, min {r_min:.2f}x")


def prefill(runner: ModelRunner, batch: int, ctx: int, room: int) -> list[StepItem]:
    """B ragged sequences in scattered blocks (block j of sequence i is i + j*B, reversed)."""
    bs = runner.block_size
    nblk = -(-(ctx + room) // bs)
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(batch):
        table = [i + j * batch for j in range(nblk)][::-1]
        length = ctx - (i * 37) % 64  # ragged: lengths differ by up to 63
        ids = torch.randint(0, runner.config.vocab_size, (length,), generator=g).tolist()
        runner.execute([StepItem(ids, 0, table)])
        items.append(StepItem(ids, 0, table))
    return items


def bench_layer(runner: ModelRunner, items: list[StepItem], rounds: int) -> None:
    attn = runner.model.model.layers[0].self_attn
    k_cache, v_cache = runner.kv_cache.k[0], runner.kv_cache.v[0]  # (Hkv, slots, D)
    bs, b = runner.block_size, len(items)
    lens = torch.tensor([len(it.token_ids) for it in items])  # (B,)
    t_max = int(lens.max())
    nblk = -(-t_max // bs)
    table = torch.tensor([it.block_table[:nblk] for it in items])  # (B, nblk)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, attn.h, attn.d, generator=g).to(k_cache.dtype)  # (B, H, D)
    mask = (torch.arange(t_max) < lens[:, None]).view(b, 1, 1, t_max)  # (B, 1, 1, T)

    def gather() -> torch.Tensor:
        kd, vd = attn._context(k_cache, v_cache, table.flatten(), bs, b, t_max)
        return attn._decode_grouped(q, kd, vd, mask)

    def kernel() -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, table, lens, bs)

    fns: dict[str, Callable[[], object]] = {"gather+sdpa": gather, "kernel": kernel}
    if b == 1:  # the lone-sequence consecutive-blocks case: a view, no copy, then SDPA
        first = runner.num_blocks - nblk  # a run of blocks nobody else uses here
        run = torch.arange(first, first + nblk).view(1, nblk)

        def view() -> torch.Tensor:
            kd, vd = attn._context(k_cache, v_cache, first, bs, 1, t_max)
            return attn._decode_grouped(q, kd, vd, None)

        def kernel_run() -> torch.Tensor:
            return paged_decode_attention(q, k_cache, v_cache, run, lens, bs)

        fns |= {"view+sdpa": view, "kernel(consec)": kernel_run}
    with torch.inference_mode():
        t = interleaved(fns, rounds, 20)
    head = {k: t[k] for k in ("gather+sdpa", "kernel")}
    report(f"  batch {b:2d} one layer", head, 1e6, "us")
    if b == 1:
        report(f"  batch {b:2d} one layer", {k: t[k] for k in ("view+sdpa", "kernel(consec)")},
               1e6, "us")


def bench_steps(runner: ModelRunner, items: list[StepItem], rounds: int, steps: int) -> None:
    pos = [len(it.token_ids) for it in items]
    state = {"pos": pos}

    def run(paged: bool) -> Callable[[], object]:
        def step() -> object:
            runner.set_paged_attention(paged)
            p = state["pos"]
            out = runner.execute([StepItem([1], q, it.block_table)
                                  for q, it in zip(p, items, strict=True)])
            state["pos"] = [q + 1 for q in p]
            return out
        return step

    t = interleaved({"gather": run(False), "kernel": run(True)}, rounds, steps)
    runner.set_paged_attention(True)
    report(f"  batch {len(items):2d} decode step", t, 1e3, "ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", nargs="+", default=["auto", "float32"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cache = cache_dir_from_env()
    print(f"threads {torch.get_num_threads()}, ctx ~{a.ctx} (ragged -63), "
          f"{a.rounds} interleaved rounds")
    for dtype_flag in a.dtype:
        runner = ModelRunner(RunnerConfig.from_settings(a.model, dtype=dtype_flag,
                                                        kv_cache_mb=768, cache_dir=str(cache)))
        dtype, gguf = runner.dtype_name, runner.runner_config.gguf_path
        if not runner.paged_attention.enabled:
            raise SystemExit(f"kernel unavailable: {runner.paged_attention.reason}")
        print(f"--dtype {dtype_flag} ({'GGUF-native' if gguf else dtype} weights, "
              f"{dtype} KV cache)")
        for b in a.batch:
            items = prefill(runner, b, a.ctx, a.rounds * a.steps * 2 + 64)
            bench_layer(runner, items, a.rounds)
            bench_steps(runner, items, a.rounds, a.steps)


if __name__ == "__main__":
    main()
