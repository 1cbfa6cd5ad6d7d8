"""Perplexity of a GGUF model (SmolLM2 by default) served each way, on the same text, through our
own forward.

    python benchmarks/bench_perplexity.py [--model default|FILE.gguf] [--text FILE ...]
        [--window 512] [--modes ...] [--score all|half] [--llama-perplexity PATH] [--rows 16]
        [--kv-cache-dtype auto|float32|bfloat16|float16]

Data flow: text (--text files; default CPython's pydoc_data.topics) -> the model's tokenizer ->
windows of --window tokens (no overlap) -> ModelRunner.forward_full (no cache) per mode ->
mean negative log-likelihood of each next token -> exp. `--score half` scores only the second
half of each window and drops a short last window: llama.cpp's `llama-perplexity` rule (each
chunk of n_ctx tokens is evaluated alone and tokens n_ctx/2+1 .. n_ctx-1 are scored; SmolLM2's
GGUF adds no BOS, so no token is replaced). With `--llama-perplexity PATH` that binary is run on
the same text, cut to the same tokens, with -c --window, and its figure is printed beside ours:
the issue's "within 0.5 % of llama.cpp's quantization of the same file". The two figures are
compared only on the same tokens: with `--llama-tokenize PATH` (default: the llama-tokenize beside
llama-perplexity, if there) llama.cpp tokenizes the text first, and the script refuses to go on
when its ids differ from ours (without it the streams are not checked, and it says so). Modes:
  float32   the GGUF dequantized to float32 by transformers (the converted folder): what the
            file's blocks mean exactly, the reference
  gguf      the file's own Q4_1/Q8_0 blocks served packed (--dtype auto, the default)
  int8/int4 the float32 weights re-quantized by our quantizers (INT4: clipping search)
`--kv-cache-dtype` is the runners' KV cache (default auto: bfloat16 on a CPU); it matters only
with `--rows`, where each window's later tokens read the earlier ones from the cache.
Prints one line per mode with its perplexity and its ratio to float32.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def perplexity(runner: object, ids: list[int], window: int, half: bool = False) -> float:
    """exp(mean NLL) over windows of `window` tokens; `half`: llama-perplexity's rule."""
    nll, count = 0.0, 0
    first = window // 2 if half else 0  # the first scored logit row of a window
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2 or (half and len(chunk) < window):
            break
        logits = runner.forward_full(chunk)  # type: ignore[attr-defined]  # (T, V) float32
        target = torch.tensor(chunk[first + 1 :])
        nll += torch.nn.functional.cross_entropy(logits[first:-1], target,
                                                 reduction="sum").item()
        count += len(target)
    return math.exp(nll / count)


def perplexity_by_rows(runner: Any, ids: list[int], window: int, half: bool,
                       rows: int) -> float:
    """As `perplexity`, but each window is fed through the serving step (ModelRunner.execute,
    the KV cache) `rows` tokens at a time: every layer sees at most `rows` rows, so the paths a
    runner chose for few rows (the integer-dot kernel up to its int_dot_rows) are the ones
    scored, as they are in decode."""
    from engine_worker.step import StepItem

    table = list(range(-(-window // runner.block_size)))
    nll, count = 0.0, 0
    first = window // 2 if half else 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2 or (half and len(chunk) < window):
            break
        logits = torch.cat([runner.execute([StepItem(chunk[p : p + rows], p, table, True)])
                            for p in range(0, len(chunk), rows)])  # (T, V)
        target = torch.tensor(chunk[first + 1 :])
        nll += torch.nn.functional.cross_entropy(logits[first:-1], target,
                                                 reduction="sum").item()
        count += len(target)
    return math.exp(nll / count)


def llama_perplexity(binary: Path, gguf: Path, text: str, window: int, chunks: int,
                     threads: int) -> float:
    """llama.cpp's own figure for `gguf` on `text` (its tokenizer, its forward), n_ctx=window."""
    import re
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text + "\n")  # -f drops one trailing newline: it then reads exactly `text`
        f.flush()
        out = subprocess.run(  # --no-escape: -f turns a backslash-n in the text into a newline
            [str(binary), "-m", str(gguf), "-f", f.name, "-c", str(window), "-b", str(window),
             "--chunks", str(chunks), "-t", str(threads), "--no-escape"],
            capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if found is None:
        raise RuntimeError("llama-perplexity printed no final estimate:\n" + out.stderr[-2000:])
    return float(found.group(1))


def check_llama_tokens(binary: Path, gguf: Path, text: str, ids: list[int], tok: Any) -> None:
    """Refuse (SystemExit) when llama.cpp tokenizes `text` other than into `ids`: the figures
    would then be of two token streams. Tokenized as llama-perplexity does it (no special
    tokens parsed; SmolLM2's GGUF asks for no BOS)."""
    import json
    import subprocess

    out = subprocess.run([str(binary), "-m", str(gguf), "--stdin", "--no-escape", "--ids",
                          "--no-bos", "--no-parse-special", "--log-disable"],
                         input=text.encode("utf-8"), capture_output=True, check=True)
    theirs = json.loads(out.stdout.decode().strip().splitlines()[-1])
    if theirs == ids:
        print(f"llama.cpp tokenizes the text into the same {len(ids)} tokens", flush=True)
        return
    at = next((i for i, (a, b) in enumerate(zip(ids, theirs, strict=False)) if a != b),
              min(len(ids), len(theirs)))
    pieces = [[tok.id_to_token(i) for i in s[max(0, at - 3) : at + 5]] for s in (ids, theirs)]
    raise SystemExit(f"refusing to compare with llama-perplexity: our tokenizer gives {len(ids)} "
                     f"tokens, llama.cpp {len(theirs)}; first difference at token {at}: ours "
                     f"{pieces[0]}, llama.cpp {pieces[1]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Perplexity of a GGUF model per serving mode.")
    ap.add_argument("--model", default="default",
                    help="'default' (the embedded SmolLM2) or a .gguf file")
    ap.add_argument("--text", type=Path, nargs="*", default=[],
                    help="default: CPython's pydoc_data.topics (as in the issue 7 report)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--modes", default="float32,gguf,int8,int4")
    ap.add_argument("--score", choices=("all", "half"), default="all",
                    help="half: score the second half of each window (llama-perplexity's rule)")
    ap.add_argument("--llama-perplexity", type=Path, default=None,
                    help="llama.cpp's llama-perplexity binary: its figure on the same text")
    ap.add_argument("--llama-tokenize", type=Path, default=None,
                    help="llama.cpp's llama-tokenize: refuse to compare unless its tokens are "
                         "ours (default: beside --llama-perplexity, if there)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=0,
                    help="feed each window through the serving step this many tokens at a time "
                         "(16: the integer-dot kernel's rows, as in decode); 0: one forward")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the KV cache's dtype (with --rows: what later tokens read)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tokenizers import Tokenizer

    from engine_worker.config import cache_dir_from_env
    from engine_worker.model.loader import gguf_source, resolve_checkpoint
    from engine_worker.model_runner import ModelRunner
    from engine_worker.runner_config import RunnerConfig
    cache = cache_dir_from_env()
    gguf = gguf_source(args.model)
    if gguf is None:
        raise SystemExit(f"--model {args.model!r}: 'default' or a .gguf file")
    float_modes = {"float32", "int8", "int4"} & set(args.modes.split(","))
    folder = resolve_checkpoint(args.model, cache, weights=bool(float_modes))
    if args.text:
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in args.text)
    else:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(text).ids[: args.max_tokens]
    text = tok.decode(ids)  # the text those tokens spell, so llama.cpp reads the same span
    name = ", ".join(p.name for p in args.text) or "pydoc_data.topics"
    print(f"text: {name}; {len(ids)} tokens, windows of {args.window}, "
          f"scoring {'the second half of each' if args.score == 'half' else 'all'}", flush=True)
    half = args.score == "half"
    llama = None
    if args.llama_perplexity is not None:
        if not half:
            print("llama-perplexity scores half windows: pass --score half to compare", flush=True)
        tokenize = args.llama_tokenize or args.llama_perplexity.with_name("llama-tokenize")
        if tokenize.is_file():
            check_llama_tokens(tokenize, gguf, text, ids, tok)
        else:
            print(f"not checked that llama.cpp reads the same tokens: no {tokenize} "
                  "(pass --llama-tokenize)", flush=True)
        llama = llama_perplexity(args.llama_perplexity, gguf, text,
                                 args.window, len(ids) // args.window, args.threads)
        print(f"llama.cpp perplexity {llama:.4f}  (llama-perplexity, same GGUF, same text)",
              flush=True)
    torch.set_num_threads(args.threads)
    ref = None
    for mode in args.modes.split(","):
        # gguf: the embedded file's own blocks; int8/int4: the float weights quantized
        dtype = "auto" if mode == "gguf" else "float32"
        quant = mode if mode in ("int8", "int4") else "none"
        runner = ModelRunner(RunnerConfig.from_settings(args.model, dtype=dtype, quantization=quant,
                                                        kv_cache_mb=256, cache_dir=str(cache),
                                                        kv_cache_dtype=args.kv_cache_dtype))
        with torch.inference_mode():
            ppl = perplexity_by_rows(runner, ids, args.window, half, args.rows) if args.rows \
                else perplexity(runner, ids, args.window, half)
        ref = ppl if ref is None else ref
        print(f"{mode:8s} perplexity {ppl:.4f}  ({(ppl / ref - 1) * 100:+.2f} % vs "
              f"{args.modes.split(',')[0]}"
              + ("" if llama is None else f", {(ppl / llama - 1) * 100:+.2f} % vs llama.cpp")
              + f")  weights {runner.weight_bytes / 2**20:.0f} MiB, {runner.kv_dtype_name} KV "
              + ("cache" if args.rows else "cache unread (one forward)"), flush=True)
        del runner
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
