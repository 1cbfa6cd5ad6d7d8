"""The worker's engine alone in a closed loop: no gateway, no client, no sockets.

    python benchmarks/bench_engine_closed_loop.py [--model M] [--prompt 200] [--new 128]
        [--streams 16] [--requests 32]

Data flow: the worker's settings (its flags' environment variables: KESTREL_STEP_FLOOR_MS,
KESTREL_STEP_PREFILL_SHARE, ...) -> the runner and Engine as the worker builds them -> probe ->
--streams requests of random --prompt token ids, greedy, --new tokens each (ignore_eos); each
finished request is replaced by the next until --requests have run, as bench_vs_llamacpp.py's
16-stream phase does through the gateway -> output tok/s over the whole loop, steps and their
mean time. With KESTREL_STEP_TRACE set, benchmarks/step_trace.py says where the time went. What
this shows against the served run is what the gateway and the clients beside the worker cost.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    args = ap.parse_args(argv)

    import torch

    from common.settings import parse_settings
    from engine_worker.config import WorkerConfig
    from engine_worker.engine import Engine
    from engine_worker.model_runner import ModelRunner
    from engine_worker.runner_config import RunnerConfig
    from protocol import messages as m

    cfg = parse_settings(WorkerConfig, ["--model", args.model], prog="bench",
                         description="engine closed loop")
    runner = ModelRunner(RunnerConfig.from_worker(cfg))
    engine = Engine(runner, max_num_seqs=cfg.max_num_seqs,
                    max_num_batched_tokens=cfg.max_num_batched_tokens,
                    prefill_share=cfg.step_prefill_share, step_floor_s=cfg.step_floor_ms / 1e3)
    engine.probe()
    gen = torch.Generator().manual_seed(0)
    params = m.SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    sent, live, produced, steps = 0, set(), 0, 0

    def send() -> None:
        nonlocal sent
        rid = f"r{sent}"
        sent += 1
        ids = torch.randint(100, runner.config.vocab_size - 100, (args.prompt,),
                            generator=gen).tolist()
        engine.add(m.Generate(rid, ids, params))
        live.add(rid)

    start = time.perf_counter()
    for _ in range(min(args.streams, args.requests)):
        send()
    while live:
        for out in engine.step():
            produced += len(out.token_ids)
            if out.finish_reason is not None:
                live.discard(out.request_id)
                if sent < args.requests:
                    send()
        steps += 1
    took = time.perf_counter() - start
    print(f"{args.model}: {args.streams} streams, {args.requests} requests of {args.prompt} + "
          f"{args.new} tokens: {produced} tokens in {took:.1f} s, {produced / took:.1f} tok/s; "
          f"{steps} steps, {1e3 * took / steps:.1f} ms a step (floor {cfg.step_floor_ms:g} ms, "
          f"share {cfg.step_prefill_share:.3f})")


if __name__ == "__main__":
    main()
