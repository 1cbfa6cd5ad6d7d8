"""Bytes per token (issue 53): one stream's decode step against the floor its bytes imply, ours
and llama.cpp's llama-server side by side on the same GGUF, in one run.

    python benchmarks/bench_bytes_per_token.py --gguf FILE [--llama-server PATH]
        [--contexts 128,2048,8192] [--tokens 64] [--repeats 3] [--threads 2]
        [--kv-cache-dtypes auto,float32] [--huge-pages auto,off]

Data flow:
  1. the host's read bandwidth: torch sums a 1 GiB float32 tensor and multiplies it as a
     matrix by a vector, with --threads threads, the best of 5 each (a decode step streams its
     weights once, as these do); probed again after each context's streams, and the floors use
     the median of the probes (a 2-vCPU Zen 4 VM read 29 to 56 GB/s within one hour)
  2. ours (`kestrel serve FILE`, default flags but --kv-cache-dtype and --huge-pages, once
     per pair listed; auto is the default of both: a bfloat16 cache on a CPU, the packed
     weights in 2 MiB pages): /health says what its decode step reads (the
     weights a token, K/V bytes a token of context, the cache's dtype); then for each context,
     --repeats streams of a prompt of that many token ids (seeded, ids in [1000, 20000)) with
     --tokens new tokens (ignore_eos), after one warm-up stream: the inter-token latency is
     the gap between streamed tokens, p50 over all repeats (a stream's first gap, after the
     prefill, is left out)
  3. llama-server (`-c` the longest context + tokens, `-np 1`, `-t --threads`), the same token
     ids through its native /completion (n_predict, ignore_eos, stream). All servers are up at
     once (idle but for the one streaming) and take turns stream by stream, so a slow spell of
     a shared host (a VM's neighbours) falls on every column alike
  4. the floor of each: (weights read + context x K/V bytes a token) / bandwidth. llama.cpp's
     bytes are the file's tensors but the embedding table (one row read; whole where it is the
     head too) and an f16 cache (its default)

Prints one Markdown table: context, our bytes and floor, our ITL p50 and its ratio to our floor,
llama-server's ITL p50, floor and ratio, and ours over llama-server's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_vs_llamacpp import free_port, stop, wait_ready  # noqa: E402


def read_bandwidth(threads: int) -> float:
    """Bytes a second this host reads streaming a 1 GiB float32 tensor, the best of 5 runs of
    two readers: its sum, and its product with a vector as a (65536, 4096) matrix (a decode
    step's own access: on an Ice Lake VM the sum read 13.5-22 GB/s where the product read 28,
    and our one-row step itself 18, so the sum alone set the floor too high)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(2**28, dtype=torch.float32)
    m, v = x.view(-1, 4096), torch.ones(4096)
    best = float("inf")
    for read in (x.sum, lambda: m @ v):
        read()
        for _ in range(5):
            t = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t)
    return x.nbytes / best


def llama_bytes(gguf: Path) -> tuple[int, int]:
    """(bytes of weights a llama.cpp decode step reads, its f16 K/V bytes a token)."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    rows = {t.name: int(t.shape[-1]) for t in r.tensors}
    embd = sizes.get("token_embd.weight", 0)
    total = sum(sizes.values()) - embd
    total += embd if "output.weight" not in sizes else embd // max(1, rows["token_embd.weight"])
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")

    def meta(key: str) -> int:
        return int(r.fields[f"{arch}.{key}"].parts[-1][0])

    layers, heads, kv = meta("block_count"), meta("attention.head_count"), \
        meta("attention.head_count_kv")
    head_dim = meta("embedding_length") // heads
    return total, 2 * layers * kv * head_dim * 2


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def stream_gaps(url: str, path: str, body: dict, marker: bytes) -> list[float]:
    """Seconds between consecutive streamed tokens (events carrying `marker`), the first
    event's gap (the prefill's) left out."""
    times: list[float] = []
    with httpx.stream("POST", url + path, json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {") and marker in line.encode():
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:], strict=False)][1:]


def itl_ours(url: str, model: str, ids: list[int], tokens: int) -> list[float]:
    body = {"model": model, "prompt": ids, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    return stream_gaps(url, "/v1/completions", body, b'"text"')


def itl_llama(url: str, ids: list[int], tokens: int) -> list[float]:
    body = {"prompt": ids, "n_predict": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "cache_prompt": False}
    return stream_gaps(url, "/completion", body, b'"content"')


def start_ours(gguf: Path, kv_dtype: str, huge_pages: str = "auto"
               ) -> tuple[subprocess.Popen, str, dict, str]:
    """`kestrel serve FILE` with this cache dtype and --huge-pages, ready and warm: its
    process, url, /health's worker (with the served context) and model id."""
    port = free_port()
    env = {**os.environ, "PORT": str(port), "KESTREL_MODEL": str(gguf),
           "KESTREL_LOG_LEVEL": "WARNING", "KESTREL_KV_CACHE_DTYPE": kv_dtype,
           "KESTREL_HUGE_PAGES": huge_pages}
    proc = subprocess.Popen([sys.executable, "-m", "kestrel.serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        [worker] = httpx.get(url + "/health", timeout=10).json()["workers"]
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        itl_ours(url, model["id"], prompt_ids(64, 7), 32)  # warm-up, not counted
    except BaseException:
        stop(proc)
        raise
    return proc, url, worker | {"max_model_len": model["max_model_len"]}, model["id"]


def start_llama(binary: Path, gguf: Path, contexts: list[int],
                args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    ctx_size = max(contexts) + args.tokens + 64
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "-t", str(args.threads), "-np", "1",
                             "-c", str(ctx_size), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        itl_llama(url, prompt_ids(64, 7), 32)  # warm-up, not counted
    except BaseException:
        stop(proc)
        raise
    return proc, url


def measure(contexts: list[int], repeats: int, tokens: int, runners: dict[str, Any],
            after_context: Any = None) -> dict[str, dict[int, float]]:
    """ITL p50 of each runner (name -> fn(ids, tokens) -> gaps) at each context, the runners
    taking turns stream by stream (ours, llama-server, ours, ...), so that a slow spell of a
    shared host falls on all of them alike rather than on whichever ran then; after_context()
    is called after each context's streams (the bandwidth probe)."""
    gaps: dict[str, dict[int, list[float]]] = {n: {c: [] for c in contexts} for n in runners}
    for ctx in contexts:
        for rep in range(repeats):  # a new prompt each time: no prefix-cache hit
            ids = prompt_ids(ctx, 1000 * ctx + rep)
            for name, run in runners.items():
                gaps[name][ctx] += run(ids, tokens)
        for name in runners:
            print(f"  {name}, context {ctx}: ITL p50 "
                  f"{1e3 * statistics.median(gaps[name][ctx]):.1f} ms", flush=True)
        if after_context is not None:
            after_context()
    return {n: {c: statistics.median(g) for c, g in by.items()} for n, by in gaps.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--contexts", default="128,2048,8192")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="ours once per --kv-cache-dtype listed (e.g. auto,float32)")
    ap.add_argument("--huge-pages", default="auto",
                    help="and once per --huge-pages listed (auto,off: the packed weights in "
                    "2 MiB pages against the block cache's 4 KiB file maps)")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    probes = [read_bandwidth(args.threads)]
    print(f"read bandwidth: {probes[0] / 1e9:.1f} GB/s ({args.threads} threads)", flush=True)

    def probe() -> None:
        probes.append(read_bandwidth(args.threads))
        print(f"read bandwidth: {probes[-1] / 1e9:.1f} GB/s", flush=True)
    procs: list[subprocess.Popen] = []
    runners: dict[str, Any] = {}
    workers: dict[str, dict] = {}
    try:
        for kv_dtype in args.kv_cache_dtypes.split(","):
            for huge in args.huge_pages.split(","):
                proc, url, worker, model = start_ours(args.gguf, kv_dtype, huge)
                procs.append(proc)
                pages = "" if huge == "auto" else f", huge pages {huge}"
                key = kv_dtype + pages
                print(f"ours ({key}): a decode step reads {worker['decode_read_mb']:.1f} MB "
                      f"of weights and {worker['kv_bytes_per_token'] / 1024:.1f} KiB of "
                      f"{worker['kv_cache_dtype']} K/V a token of context; served context "
                      f"{worker['max_model_len']}", flush=True)
                workers[key] = worker | {"label": worker["kv_cache_dtype"] + pages}
                runners[f"ours ({key} cache)"] = partial(itl_ours, url, model)
        if args.llama_server is not None:
            proc, url = start_llama(args.llama_server, args.gguf, contexts, args)
            procs.append(proc)
            runners["llama-server"] = partial(itl_llama, url)
        else:
            print("no --llama-server given: its column is left out")
        itl = measure(contexts, args.repeats, args.tokens, runners, probe)
    finally:
        for proc in procs:
            stop(proc)
    bw = statistics.median(probes)
    print(f"the floors below use the median of {len(probes)} probes, {bw / 1e9:.1f} GB/s "
          f"(from {min(probes) / 1e9:.1f} to {max(probes) / 1e9:.1f})", flush=True)
    runs = {k: (w, itl[f"ours ({k} cache)"]) for k, w in workers.items()}
    theirs: dict = itl.get("llama-server", {})
    lw, lkv = llama_bytes(args.gguf)
    print("\n| context | ours: KV cache | MB read | floor (ms) | ITL p50 (ms) | / floor | "
          "llama-server: MB read | floor (ms) | ITL p50 (ms) | / floor | ours / theirs |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ctx in contexts:
        for worker, ours in runs.values():
            w, kv = worker["decode_read_mb"] * 1e6, worker["kv_bytes_per_token"]
            ob, lb = w + ctx * kv, lw + ctx * lkv
            of, lf = ob / bw, lb / bw
            row = [f"{ctx}", worker["label"], f"{ob / 1e6:.0f}", f"{1e3 * of:.1f}",
                   f"{1e3 * ours[ctx]:.1f}", f"{ours[ctx] / of:.2f}", f"{lb / 1e6:.0f}",
                   f"{1e3 * lf:.1f}"]
            if ctx in theirs:
                row += [f"{1e3 * theirs[ctx]:.1f}", f"{theirs[ctx] / lf:.2f}",
                        f"{ours[ctx] / theirs[ctx]:.2f}"]
            else:
                row += ["", "", ""]
            print("| " + " | ".join(row) + " |")
    print("\n" + json.dumps({"bandwidth_gbs": bw / 1e9, "llama": theirs,
                             "ours": {k: {"itl": o, "worker": w} for k, (w, o) in runs.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
