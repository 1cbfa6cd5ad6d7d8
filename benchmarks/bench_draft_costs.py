"""What a draft-model round costs, in process: a decode step, and the matmuls at k + 1 rows.

    python benchmarks/bench_draft_costs.py --gguf FILE [--rows 1,2,3,4,5] [--passes 15]
        [--requantize q4_0]   (the file's blocks as a draft is served: see requantize.py)

Data flow: the model as a worker serves it (RunnerConfig defaults, its matmul plan) -> a
32-token prompt, then one-token decode steps through ModelRunner.execute (the C++ decode stack,
attention, the head; logits out, no sampling), timed -> then the same model's packed layer
matrices and head through the integer-dot kernel alone, layer by layer, at each row count
of --rows (a draft-model round verifies k + 1 rows as decodes). Prints medians and minima in ms.

The draft-speculation bound in INFERENCE_BENCHMARK_REPORT.md takes its draft step (the 0.5B's
one-row step) and its verification (the 1.5B's layers and head at k + 1 rows) from here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_worker import int_dot  # noqa: E402
from engine_worker.block_manager import BlockManager  # noqa: E402
from engine_worker.model.int_dot_linear import IntDotLinear  # noqa: E402
from engine_worker.model_runner import ModelRunner  # noqa: E402
from engine_worker.runner_config import RunnerConfig  # noqa: E402
from engine_worker.step import StepItem  # noqa: E402


def timed(fn, passes: int) -> tuple[float, float]:
    """(median, min) of `passes` calls of fn, in ms, after three untimed ones."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3, min(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--rows", default="1,2,3,4,5")
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--requantize", default="none",
                    help="q4_0: the file's wider blocks re-quantized, as a draft is served")
    args = ap.parse_args()
    runner = ModelRunner(replace(RunnerConfig.from_settings(args.gguf, kv_cache_mb=256),
                                 requantize=args.requantize))
    blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
    table: list[int] = []
    blocks.extend(table, 32 + 3 + args.passes + 1)
    runner.execute([StepItem(list(range(100, 132)), 0, table)])
    pos = [32]

    def step() -> None:
        runner.execute([StepItem([200], pos[0], table)])
        pos[0] += 1

    med, low = timed(step, args.passes)
    print(f"{Path(args.gguf).name} ({args.requantize}, {runner.decode_read_bytes / 1e6:.1f} MB "
          f"a token): a one-row decode step (runner.execute) {med:.2f} ms "
          f"(min {low:.2f}), torch threads {torch.get_num_threads()}, int_dot {int_dot.isa()}")
    model = runner.model
    layers = [m.packed for m in model.model.layers.modules() if isinstance(m, IntDotLinear)]
    head = model.lm_head.packed if hasattr(model.lm_head, "packed") else None
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {p.k: torch.randn(rows, p.k) for p in layers}
        xh = torch.randn(rows, layers[0].k)
        med, low = timed(lambda xs=xs: [int_dot.mm(p, xs[p.k]) for p in layers], args.passes)
        line = f"rows {rows}: layers' kernels {med:.2f} ms (min {low:.2f})"
        if head is not None:
            hm, hl = timed(lambda xh=xh: int_dot.mm(head, xh), args.passes)
            line += f", head ({head.fmt}) {hm:.2f} ms (min {hl:.2f}), together {med + hm:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
