"""Eager against compiled decode steps (issue 10), side by side in one process, plus the compile
time on a first start (empty Inductor cache) and a second one (same cache).

    python benchmarks/bench_compiled_decode.py [--model default] [--batch 1,16] [--steps 64]
        [--rounds 4] [--threads 2] [--dtype auto] [--cache-dir DIR]

Data flow: two child processes load the model with --compile decode against one cache folder
(fresh unless --cache-dir is given) and warm the buckets this run needs: the first start's and
second start's seconds. Then this process loads it once more (same cache) and, per batch size,
prefills the batch, then alternates chunks of eager and compiled greedy steps on the same
sequences (eager = the same runner with its compiled path set aside), printing ms/step of each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

import engine_worker
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem

KESTREL_CACHE = Path.home() / ".cache" / "kestrel"


def load(args: argparse.Namespace, cache: Path) -> tuple[ModelRunner, float]:
    most = max(batches(args))
    cfg = RunnerConfig.from_settings(args.model, dtype=args.dtype, kv_cache_mb=1024,
                                     threads=args.threads or 0, compile="decode",
                                     max_num_seqs=most, max_num_batched_tokens=max(512, most),
                                     cache_dir=str(KESTREL_CACHE))
    t0 = time.monotonic()
    # the checkpoint from the usual cache, the compiled graphs in this run's own
    runner = ModelRunner(replace(cfg, cache_dir=cache))
    return runner, time.monotonic() - t0


def batches(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.batch.split(",")]


def buckets(runner: ModelRunner, args: argparse.Namespace) -> list[tuple[int, int]]:
    """Every (batch, blocks) bucket the timed steps of this run use."""
    c = runner.compiled
    assert c is not None
    bs = runner.block_size
    ctx = range(args.prompt + 1, args.prompt + args.steps + 1)
    return sorted({c.bucket(b, -(-n // bs)) for b in batches(args) for n in ctx})


def child(args: argparse.Namespace) -> None:
    """One 'start': load, warm this run's buckets, print seconds as JSON."""
    runner, load_s = load(args, Path(args.cache_dir))
    assert runner.compiled is not None
    with torch.inference_mode():
        warm_s = runner.compiled.warm(buckets(runner, args))
    print(json.dumps({"load_s": load_s, "compile_s": warm_s}), flush=True)


def start(args: argparse.Namespace, cache: Path) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", "--cache-dir", str(cache), "--model", args.model,
           "--batch", args.batch, "--prompt", str(args.prompt), "--steps", str(args.steps),
           "--threads", str(args.threads), "--dtype", args.dtype]
    # the child imports the same engine_worker as this process (a worktree, not the install)
    root = str(Path(engine_worker.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(args: argparse.Namespace, cache: Path) -> None:
    runner, _ = load(args, cache)
    compiled = runner.compiled
    bs = runner.block_size
    nblk = -(-(args.prompt + args.steps + 1) // bs)
    chunk = max(1, args.steps // (2 * args.rounds))
    for b in batches(args):
        tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(b)]
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, 40000, (b, args.prompt), generator=g).tolist()
        runner.compiled = None
        toks = runner.execute([StepItem(prompts[i], 0, tables[i]) for i in range(b)]).argmax(-1)
        runner.compiled = compiled
        if compiled is not None:  # the bucket's graph loads once, outside the timing
            with torch.inference_mode():
                compiled.warm(buckets(runner, args))
        pos = args.prompt
        spent = {"eager": 0.0, "compiled": 0.0}
        steps = {"eager": 0, "compiled": 0}
        while pos < args.prompt + args.steps:
            for mode in ("eager", "compiled"):
                runner.compiled = compiled if mode == "compiled" else None
                n = min(chunk, args.prompt + args.steps - pos)
                t0 = time.perf_counter()
                for _ in range(n):
                    items = [StepItem([int(toks[i])], pos, tables[i]) for i in range(b)]
                    toks = runner.execute(items).argmax(-1)
                    pos += 1
                spent[mode] += time.perf_counter() - t0
                steps[mode] += n
        runner.compiled = compiled
        e, c = (spent[m] / max(1, steps[m]) * 1e3 for m in ("eager", "compiled"))
        print(f"batch {b}: eager {e:.1f} ms/step, compiled {c:.1f} ms/step "
              f"(compiled/eager {c / e:.2f}; {steps['eager']}+{steps['compiled']} steps)",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="eager/compiled alternations")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cache-dir", default="", help="Inductor cache parent (default: fresh)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="kestrel-compile-") as tmp:
        cache = Path(args.cache_dir or tmp)
        first, second = start(args, cache), start(args, cache)
        print(f"first start: load {first['load_s']:.1f} s, compile {first['compile_s']:.1f} s; "
              f"second start: load {second['load_s']:.1f} s, compile from cache "
              f"{second['compile_s']:.1f} s (buckets of batch {args.batch}, "
              f"context {args.prompt}..{args.prompt + args.steps})", flush=True)
        compare(args, cache)


if __name__ == "__main__":
    main()
