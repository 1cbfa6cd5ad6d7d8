"""Structured output: the token mask's cost per step, and constrained vs unconstrained decode.

    python benchmarks/bench_structured.py [--model default] [--new 64] [--batches 1 16]

1. Mask cost per step (no model): B matchers under a JSON-schema grammar, each walked along a
   valid document token by token; per step we time `GrammarCompiler.allowed_tokens` (llguidance
   fills the bitmask for the B rows, we unpack it to a (B, V) bool tensor), then that plus the
   torch.where the sampler applies it with, and report medians (and the p90) in microseconds.
2. Decode tok/s through our Engine, the same B random prompts, unconstrained (ignore_eos) vs
   constrained by a JSON schema that cannot end early (an array with minItems 1000 of objects
   with a string and an integer), so both runs produce exactly B * new tokens, sampled at
   temperature 0.7 with a seed. The two runs alternate `--repeat` times in one process and the
   best of each is kept, so a noisy shared machine hurts both alike.
Prints Markdown. No assertion: figures go to INFERENCE_BENCHMARK_REPORT.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DOC_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "status": {"enum": ["active", "inactive"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "label": {"type": "string"}, "count": {"type": "integer"}},
            "required": ["label", "count"]}},
    },
    "required": ["name", "status", "items"],
}
DOC = {"name": "A fairly long name for a record", "status": "active",
       "items": [{"label": f"item number {i}", "count": i * 37} for i in range(12)]}
ENDLESS = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"label": {"type": "string", "maxLength": 24},
                                     "count": {"type": "integer"}},
    "required": ["label", "count"], "additionalProperties": False}}


def mask_cost(path: Path, batch: int) -> tuple[float, float, float, int]:
    import torch
    from tokenizers import Tokenizer

    from engine_worker.grammar import GrammarCompiler, advance_all
    from gateway.prompt.structured import json_grammar

    tok_json = (path / "tokenizer.json").read_text()
    cfg = json.loads((path / "config.json").read_text())
    compiler = GrammarCompiler(tok_json, cfg["vocab_size"], [2, 0])
    grammar = json_grammar(DOC_SCHEMA)
    ids = Tokenizer.from_str(tok_json).encode(json.dumps(DOC, separators=(",", ":")),
                                              add_special_tokens=False).ids
    matchers = [compiler.matcher(grammar) for _ in range(batch)]
    logits = torch.randn(batch, cfg["vocab_size"])  # (B, V)
    times, fills = [], []
    for token in ids:
        t0 = time.perf_counter()
        allowed = compiler.allowed_tokens(matchers)  # (B, V)
        t1 = time.perf_counter()
        torch.where(allowed, logits, float("-inf"))  # (B, V) what the sampler does
        times.append(time.perf_counter() - t0)
        fills.append(t1 - t0)
        assert bool(allowed[:, token].all()), "the document's next token must be allowed"
        advance_all(matchers, [token] * batch)
    times.sort()
    return (statistics.median(fills) * 1e6, statistics.median(times) * 1e6,
            times[int(len(times) * 0.9)] * 1e6, len(ids))


def decode_rate(engine, batch: int, new: int, grammar: str | None, tag: str) -> float:  # noqa: ANN001
    import torch

    from protocol import messages as m

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (batch, 32), generator=g).tolist()
    params = m.SamplingParams(max_tokens=new, temperature=0.7, seed=1,
                              ignore_eos=grammar is None)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add(m.Generate(f"{tag}{i}", ids, params, grammar=grammar))
    produced = 0
    while engine.has_work:
        produced += sum(len(o.token_ids) for o in engine.step())
    assert produced == batch * new, (produced, batch * new)
    return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from engine_worker.config import default_cache_dir
    from engine_worker.engine import Engine
    from engine_worker.grammar import GrammarCompiler
    from engine_worker.model.loader import resolve_checkpoint
    from engine_worker.model_runner import ModelRunner
    from engine_worker.runner_config import RunnerConfig
    from gateway.prompt.structured import json_grammar

    path = resolve_checkpoint(args.model, Path(default_cache_dir()))
    print("| batch | llguidance masks + unpack, median us | + applied to logits, median us | "
          "+ applied, p90 us | steps |")
    print("|---|---|---|---|---|")
    for b in args.batches:
        fill, med, p90, n = mask_cost(path, b)
        print(f"| {b} | {fill:.0f} | {med:.0f} | {p90:.0f} | {n} |")

    runner = ModelRunner(RunnerConfig.from_settings(path, dtype="float32", kv_cache_mb=1024,
                                                    cache_dir=default_cache_dir()))
    compiler = GrammarCompiler((path / "tokenizer.json").read_text(), runner.config.vocab_size,
                               list(runner.config.eos_token_ids))
    engine = Engine(runner, max_num_seqs=32, max_num_batched_tokens=2048,
                    enable_prefix_caching=False, grammars=compiler)
    grammar = json_grammar(ENDLESS)
    decode_rate(engine, 2, 8, None, "warm")
    print("\n| batch | unconstrained tok/s | constrained tok/s | ratio |")
    print("|---|---|---|---|")
    for b in args.batches:
        free, bound = [], []
        for r in range(args.repeat):
            free.append(decode_rate(engine, b, args.new, None, f"f{b}-{r}-"))
            bound.append(decode_rate(engine, b, args.new, grammar, f"c{b}-{r}-"))
        print(f"| {b} | {max(free):.1f} | {max(bound):.1f} | {max(bound) / max(free):.3f} |")


if __name__ == "__main__":
    main()
