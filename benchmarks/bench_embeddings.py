"""/v1/embeddings on our server: how fast inputs are embedded, and what embedding work beside
streams does to their inter-token time (the steps' prompt rows are sized by measured time, so
decoders should keep their pace).

    python benchmarks/bench_embeddings.py [--gguf FILE] [--inputs 256] [--batch 32] [--streams 4]

Starts `kestrel serve` (default flags; the embedded SmolLM2 unless --gguf), then measures:
1. embeddings alone: --inputs sentences of 20-60 words, --batch per request, one client;
2. --streams streamed completions of 128 tokens alone, then again while one client sends
   embedding batches in a loop: ITL p50 / p99 of each.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_vs_llamacpp import free_port, start_ours, stop, wait_ready  # noqa: E402

WORDS = ("the a cat dog river market engine winter garden signal paper kernel window cloud "
         "letter station quiet bright slowly measured between under across record value").split()


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "."
            for _ in range(n)]


def embed_all(url: str, texts: list[str], batch: int) -> dict[str, float]:
    started, tokens = time.perf_counter(), 0
    with httpx.Client(timeout=600) as client:
        for i in range(0, len(texts), batch):
            out = client.post(url + "/v1/embeddings", json={"input": texts[i : i + batch]})
            out.raise_for_status()
            tokens += out.json()["usage"]["prompt_tokens"]
    seconds = time.perf_counter() - started
    return {"inputs": len(texts), "tokens": tokens, "seconds": round(seconds, 2),
            "inputs_per_s": round(len(texts) / seconds, 1),
            "tokens_per_s": round(tokens / seconds, 1)}


def stream_gaps(url: str, prompt: str) -> list[float]:
    gaps, last = [], None
    body = {"prompt": prompt, "max_tokens": 128, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=600) as client, \
            client.stream("POST", url + "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


def streams(url: str, n: int) -> dict[str, float]:
    prompts = [f"Story {i}: once upon a time" for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        gaps = [g for part in pool.map(lambda p: stream_gaps(url, p), prompts) for g in part]
    gaps.sort()
    return {"itl_p50_ms": round(1e3 * statistics.median(gaps), 1),
            "itl_p99_ms": round(1e3 * gaps[int(0.99 * (len(gaps) - 1))], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--streams", type=int, default=4)
    args = ap.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_ours("auto", args.gguf, port)
    try:
        wait_ready(url, proc)
        embed_all(url, sentences(8, 0), 8)  # warm-up
        result: dict[str, object] = {"model": str(args.gguf or "default")}
        result["embeddings_alone"] = embed_all(url, sentences(args.inputs, 1), args.batch)
        result["streams_alone"] = streams(url, args.streams)
        stop_flag, done = threading.Event(), []

        def embed_loop() -> None:
            texts = sentences(args.batch, 2)
            while not stop_flag.is_set():
                done.append(embed_all(url, texts, args.batch)["inputs"])

        loop = threading.Thread(target=embed_loop)
        loop.start()
        time.sleep(0.5)
        result["streams_beside_embeddings"] = streams(url, args.streams)
        stop_flag.set()
        loop.join()
        result["inputs_embedded_meanwhile"] = sum(done)
        print(json.dumps(result, indent=1))
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
