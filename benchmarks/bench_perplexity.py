"""Perplexity of SmolLM2 served each way, on the same text, through our own forward.

    python benchmarks/bench_perplexity.py [--text FILE ...] [--window 512] [--modes ...]

Data flow: text (--text files; default CPython's pydoc_data.topics) -> SmolLM2's tokenizer ->
windows of --window tokens (no overlap) -> ModelRunner.forward_full (no cache) per mode ->
mean negative log-likelihood of each next token -> exp. Modes:
  float32   the GGUF dequantized to float32 by transformers (the converted folder): what the
            file's blocks mean exactly, the reference
  gguf      the file's own Q4_1/Q8_0 blocks served packed (--dtype auto, the default)
  int8/int4 the float32 weights re-quantized by our quantizers (INT4: clipping search)
Prints one line per mode with its perplexity and its ratio to float32.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def perplexity(runner: object, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        logits = runner.forward_full(chunk)  # type: ignore[attr-defined]  # (T, V) float32
        target = torch.tensor(chunk[1:])
        nll += torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Perplexity of SmolLM2 per serving mode.")
    ap.add_argument("--text", type=Path, nargs="*", default=[],
                    help="default: CPython's pydoc_data.topics (as in the issue 7 report)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--modes", default="float32,gguf,int8,int4")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tokenizers import Tokenizer

    from engine_worker.model.loader import embedded_gguf_path, resolve_checkpoint
    from engine_worker.model_runner import ModelRunner

    cache = Path(os.environ.get("KESTREL_CACHE_DIR", Path.home() / ".cache" / "kestrel"))
    folder = resolve_checkpoint("default", cache)
    if args.text:
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in args.text)
    else:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids[: args.max_tokens]
    name = ", ".join(p.name for p in args.text) or "pydoc_data.topics"
    print(f"text: {name}; {len(ids)} tokens, windows of "
          f"{args.window}", flush=True)
    ref = None
    for mode in args.modes.split(","):
        kw: dict[str, object] = {"kv_budget_bytes": 256 << 20}
        if mode == "gguf":
            kw["gguf_path"] = embedded_gguf_path()
        elif mode in ("int8", "int4"):
            kw["quantization"] = mode
        runner = ModelRunner(folder, **kw)  # type: ignore[arg-type]
        with torch.inference_mode():
            ppl = perplexity(runner, ids, args.window)
        ref = ppl if ref is None else ref
        print(f"{mode:8s} perplexity {ppl:.4f}  ({(ppl / ref - 1) * 100:+.2f} % vs "
              f"{args.modes.split(',')[0]})  weights {runner.weight_bytes / 2**20:.0f} MiB",
              flush=True)
        del runner
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
