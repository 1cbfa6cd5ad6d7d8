"""Weight-only quantization: size, memory, perplexity and decode speed of float32, bfloat16,
INT8 and INT4 (groups of 32 and 64) on SmolLM2, plus error on a tiny random Gaussian model.

    python benchmarks/bench_quant.py [--model default] [--ppl-tokens 20480] [--steps 64]

Each configuration runs in its own subprocess, so its peak resident memory (ru_maxrss) is its
own. Note the peak includes the float32 checkpoint as loaded: quantization runs after loading,
so "RSS after" (resident memory once converted, after gc) is the figure a serving worker keeps.

Perplexity: the text of CPython's `pydoc_data.topics` (ships with every Python, no download),
tokenized with the model's tokenizer, the first --ppl-tokens tokens scored in non-overlapping
1,024-token windows through our model's forward (ModelRunner.forward_full), the first token
of each window unscored. Decode: greedy through ModelRunner.execute on the paged KV cache,
--prompt random tokens then --steps decode steps, at batch 1 and 16 (tokens/s over the steps).

SmolLM2's float weights are themselves dequantized from 4-bit groups of 32 (Q4_1 GGUF), which
flatters INT4 with group 32; so each row also quantizes a tiny random model with plain Gaussian
weights and reports the relative weight reconstruction error ||W - W_q|| / ||W|| and the mean
KL(float || quantized) of next-token distributions. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = {  # name -> (dtype, quantization, group size)
    "float32": ("float32", "none", 32),
    "bfloat16": ("bfloat16", "none", 32),
    "int8": ("float32", "int8", 32),
    "int4-g32": ("float32", "int4", 32),
    "int4-g64": ("float32", "int4", 64),
}
WINDOW = 1024


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _ppl_tokens(checkpoint: Path, n: int) -> list[int]:
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(text).ids
    if len(ids) < n:
        raise SystemExit(f"pydoc_data.topics has only {len(ids)} tokens, {n} asked")
    return ids[:n]


def perplexity(runner, ids: list[int]) -> float:  # type: ignore[no-untyped-def]
    import torch

    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        win = ids[start : start + WINDOW]
        if len(win) < 2:
            break
        logits = runner.forward_full(win)  # (T, V) float32
        target = torch.tensor(win[1:])
        nll += torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum").item()
        count += len(win) - 1
    return float(torch.exp(torch.tensor(nll / count)))


def decode_tps(runner, batch: int, prompt: int, steps: int) -> float:  # type: ignore[no-untyped-def]
    import torch

    from engine_worker.step import StepItem

    nblk = -(-(prompt + steps + 2) // runner.block_size)  # + 2 warm-up steps
    tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (batch, prompt), generator=g).tolist()
    toks = runner.execute([StepItem(prompts[i], 0, tables[i]) for i in range(batch)]).argmax(-1)
    for s in range(2):  # warm-up steps, not timed
        items = [StepItem([int(toks[i])], prompt + s, tables[i]) for i in range(batch)]
        toks = runner.execute(items).argmax(-1)
    t0 = time.perf_counter()
    for s in range(2, steps + 2):
        items = [StepItem([int(toks[i])], prompt + s, tables[i]) for i in range(batch)]
        toks = runner.execute(items).argmax(-1)
    return batch * steps / (time.perf_counter() - t0)


def tiny_errors(checkpoint: Path, dtype_name: str, mode: str, group: int) -> tuple[float, float]:
    """(relative weight error, mean KL) of one config on a tiny random Gaussian model."""
    import torch

    from engine_worker.model.attention import AttnMeta, PrefillSpan
    from engine_worker.model.quant import quantize_model
    from engine_worker.model.tiny import make_tiny_checkpoint
    from engine_worker.model.weights import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp), seed=0, num_layers=4, hidden_size=256,
                                    num_heads=4, num_kv_heads=2, intermediate_size=768,
                                    tokenizer_from=checkpoint, initializer_range=0.02)
        ref = load_model(path, torch.float32, "cpu", max_positions=256)
        model = load_model(path, getattr(torch, dtype_name), "cpu", max_positions=256)
    floats = {n: m.weight.detach().clone() for n, m in ref.named_modules()
              if isinstance(m, torch.nn.Linear)}
    floats["lm_head"] = ref.model.embed_tokens.weight
    quantize_model(model, mode, group)
    num = den = 0.0
    for name, w in floats.items():
        mod = model.get_submodule(name) if name != "lm_head" else model.lm_head
        if mod is None:  # float16/bfloat16 rows: the tied embedding is the head
            mod = model.model.embed_tokens
        wq = mod.dequantize() if hasattr(mod, "dequantize") else mod.weight.float()
        num += (wq.float() - w).pow(2).sum().item()
        den += w.pow(2).sum().item()
    ids = torch.randint(0, 49152, (256,), generator=torch.Generator().manual_seed(1))
    meta = AttnMeta(slot_mapping=None, prefills=[PrefillSpan(0, 256, 0)])
    with torch.inference_mode():
        p = ref(ids, torch.arange(256), meta, None).log_softmax(-1)
        q = model(ids, torch.arange(256), meta, None).log_softmax(-1)
    kl = torch.nn.functional.kl_div(q, p, log_target=True, reduction="batchmean").item()
    return (num / den) ** 0.5, kl


def row(
    name: str, model: str, ppl_tokens: int, prompt: int, steps: int, threads: int
) -> dict[str, float]:
    import ctypes

    import torch

    if threads:
        torch.set_num_threads(threads)

    from engine_worker.model.quant import quantize_model, weight_bytes
    from engine_worker.model_runner import ModelRunner
    from engine_worker.runner_config import RunnerConfig

    dtype, mode, group = CONFIGS[name]
    # float weights, quantized below (timed apart from the load)
    runner = ModelRunner(RunnerConfig.from_settings(model, dtype=dtype, kv_cache_mb=256,
                                                    max_model_len=2048))
    path = runner.runner_config.model_path
    quantize_model(runner.model, mode, group)
    gc.collect()
    try:  # hand the freed float weights back to the OS, so "RSS after" shows what is kept
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    out = {"weight_mb": weight_bytes(runner.model) / 1e6, "rss_after_mib": _rss_mib()}
    out["ppl"] = perplexity(runner, _ppl_tokens(path, ppl_tokens))
    out["tps1"] = decode_tps(runner, 1, prompt, steps)
    out["tps16"] = decode_tps(runner, 16, prompt, steps)
    out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["tiny_werr"], out["tiny_kl"] = tiny_errors(path, dtype, mode, group)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--ppl-tokens", type=int, default=20480)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    if args.row:
        print(json.dumps(row(args.row, args.model, args.ppl_tokens, args.prompt, args.steps,
                             args.threads)))
        return
    results: dict[str, dict[str, float]] = {}
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--row", name, "--model", args.model, "--ppl-tokens",
               str(args.ppl_tokens), "--prompt", str(args.prompt), "--steps", str(args.steps),
               "--threads", str(args.threads)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    base = results.get("float32")
    print(f"\n`python benchmarks/bench_quant.py --ppl-tokens {args.ppl_tokens} --prompt "
          f"{args.prompt} --steps {args.steps} --threads {args.threads}`\n")
    print("| config | weights MB | peak RSS MiB | RSS after MiB | perplexity | vs fp32 | "
          "decode tok/s b=1 | x fp32 | decode tok/s b=16 | x fp32 | tiny W err | tiny KL |")
    print("|---" * 12 + "|")
    for name, r in results.items():
        rel = (f"{(r['ppl'] / base['ppl'] - 1) * 100:+.2f} %" if base else "")
        x1 = f"{r['tps1'] / base['tps1']:.2f}x" if base else ""
        x16 = f"{r['tps16'] / base['tps16']:.2f}x" if base else ""
        print(f"| {name} | {r['weight_mb']:.1f} | {r['peak_mib']:.0f} | {r['rss_after_mib']:.0f} "
              f"| {r['ppl']:.3f} | {rel} | {r['tps1']:.1f} | {x1} | {r['tps16']:.1f} | {x16} "
              f"| {r['tiny_werr']:.4f} | {r['tiny_kl']:.5f} |")


if __name__ == "__main__":
    main()
