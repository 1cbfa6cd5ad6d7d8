"""Engine throughput: our engine vs transformers' generate() vs our loop without a KV cache.

    python benchmarks/bench_engine.py [--model default] [--prompt 128] [--new 128]

Each row runs in its own subprocess so its peak resident memory (ru_maxrss) is its own. Rows:
  ours, concurrency 1/4/8/16   - requests added to the Engine together, greedy, ignore_eos
  hf generate, batch 1/4/8/16  - transformers' model.generate(), left-padded, greedy
  ours, no KV cache, batch 1   - recompute the whole sequence at every step (our model)
Output tokens/s counts generated tokens over the wall time of the whole row (prefill included).
Prints a Markdown table. No assertion: figures go to INFERENCE_BENCHMARK_REPORT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _prompts(batch: int, length: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(100, 40000, (batch, length), generator=g).tolist()


def row_ours(path: Path, batch: int, prompt: int, new: int) -> float:

    from engine_worker.engine import Engine
    from engine_worker.model_runner import ModelRunner
    from engine_worker.runner_config import RunnerConfig
    from protocol import messages as m

    runner = ModelRunner(RunnerConfig.from_settings(path, dtype="float32", kv_cache_mb=1024))
    engine = Engine(runner, max_num_seqs=max(16, batch), max_num_batched_tokens=2048)
    params = m.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    warm = m.Generate("warm", _prompts(1, 16)[0], m.SamplingParams(max_tokens=4, temperature=0))
    engine.add(warm)
    while engine.has_work:
        engine.step()
    start = time.perf_counter()
    for i, ids in enumerate(_prompts(batch, prompt)):
        engine.add(m.Generate(f"r{i}", ids, params))
    produced = 0
    while engine.has_work:
        produced += sum(len(o.token_ids) for o in engine.step())
    assert produced == batch * new
    return produced / (time.perf_counter() - start)


def row_hf(path: Path, batch: int, prompt: int, new: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 local_files_only=True).eval()
    ids = torch.tensor(_prompts(batch, prompt))  # equal lengths: left padding is a no-op
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids[:1, :16], attention_mask=mask[:1, :16], max_new_tokens=4,
                       do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - prompt) * batch
    return produced / elapsed


def row_nokv(path: Path, batch: int, prompt: int, new: int) -> float:

    from engine_worker.model_runner import ModelRunner
    from engine_worker.runner_config import RunnerConfig

    runner = ModelRunner(RunnerConfig.from_settings(path, dtype="float32", kv_cache_mb=256))
    ids = _prompts(1, prompt)[0]
    start = time.perf_counter()
    for _ in range(new):
        ids.append(int(runner.forward_full(ids)[-1].argmax()))
    return new / (time.perf_counter() - start)


ROWS = {"ours": row_ours, "hf": row_hf, "nokv": row_nokv}


def run_row(kind: str, batch: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--row", f"{kind}:{batch}", "--model", args.model,
           "--prompt", str(args.prompt), "--new", str(args.new), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--row", help="internal: run one row, print JSON")
    args = ap.parse_args()
    from engine_worker.config import cache_dir_from_env
    from engine_worker.model.loader import resolve_checkpoint
    cache = cache_dir_from_env()
    path = resolve_checkpoint(args.model, cache)
    if args.row:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        kind, batch = args.row.split(":")
        tps = ROWS[kind](path, int(batch), args.prompt, args.new)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"kind": kind, "batch": int(batch), "tokens_per_s": tps,
                          "peak_rss_mb": peak_mb}))
        return
    batches = [int(b) for b in args.batches.split(",")]
    rows = [run_row("ours", b, args) for b in batches]
    rows += [run_row("hf", b, args) for b in batches]
    rows.append(run_row("nokv", 1, args))
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["kind"] == "hf"}
    ours1 = next(r["tokens_per_s"] for r in rows if r["kind"] == "ours" and r["batch"] == 1)
    names = {"ours": "kestrel engine", "hf": "transformers generate()",
             "nokv": "kestrel, no KV cache (recompute)"}
    threads = args.threads or "default"
    print(f"prompt {args.prompt} tokens, {args.new} new tokens, greedy, float32, "
          f"{os.cpu_count()} CPUs, torch threads: {threads}\n")
    print("| engine | concurrency | output tok/s | vs generate() same batch | vs our batch 1 "
          "| peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["tokens_per_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
        print(f"| {names[r['kind']]} | {r['batch']} | {r['tokens_per_s']:.1f} | {ratio:.2f}x | "
              f"{r['tokens_per_s'] / ours1:.2f}x | {r['peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
