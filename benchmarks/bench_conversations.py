"""Agent-like conversations at once (issue 53): each sends a source file of ~2,500 tokens and a
question, then two follow-ups in the same conversation (its earlier turns and answers sent again,
as a chat client does), 64 new tokens a turn; ours and llama-server on the same GGUF, one after
the other, in one run.

    python benchmarks/bench_conversations.py --gguf FILE [--llama-server PATH]
        [--conversations 4] [--file-tokens 2500] [--tokens 64] [--threads 2]
        [--kv-cache-dtype auto]

Data flow: ours starts first (`kestrel serve FILE`, default flags but --kv-cache-dtype); each
conversation's file is the start of a different module of Python's standard library, cut to
--file-tokens tokens by our /tokenize (so both servers get the same text). Then, per server,
all conversations start together, each a thread of the official `openai` client streaming
/v1/chat/completions (temperature 0, max_tokens --tokens; `ignore_eos` so every turn writes
them all): turn 1 the file and a question, turns 2 and 3 a follow-up after the answers so far.
llama-server runs with `-np` one slot per conversation and `-c` room for them all; it keeps a
slot's prompt cache between turns by default, as ours keeps its prefix cache.
Prints, per server: output tokens a second over the run's wall time, the first turn's TTFT p50,
the follow-ups' TTFT p50, and the wall time; then ours over theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_vs_llamacpp import free_port, stop, wait_ready  # noqa: E402

MODULES = ("argparse", "dataclasses", "inspect", "subprocess", "typing", "tarfile", "pathlib",
           "logging/__init__")
QUESTIONS = ("Explain what the main class in this file does, briefly.",
             "Now write a short unit test for one of its functions.",
             "What would you rename to make it clearer? One line each.")


def source_files(url: str, model: str, n: int, tokens: int) -> list[str]:
    """n stdlib modules, each cut to about `tokens` tokens of this model's tokenizer."""
    lib = Path(os.__file__).parent
    out = []
    for name in MODULES[:n]:
        text = (lib / f"{name}.py").read_text()
        chars = tokens * 4  # code runs ~3-4 characters a token: cut, then trim by count
        for _ in range(6):
            resp = httpx.post(url + "/tokenize", json={"model": model, "prompt": text[:chars]},
                              timeout=60)
            count = resp.json()["count"]
            if abs(count - tokens) <= tokens // 100:
                break
            chars = int(chars * tokens / count)
        out.append(text[:chars])
    return out


def converse(client: openai.OpenAI, model: str, file: str, tokens: int,
             out: list[tuple[int, float, int]]) -> None:
    """Three turns; (turn, TTFT seconds, tokens streamed) appended to out for each."""
    messages: list[dict] = [{"role": "user", "content": f"```python\n{file}\n```\n\n"
                             f"{QUESTIONS[0]}"}]
    for turn in range(3):
        t0 = time.perf_counter()
        first, text, count = None, [], 0
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
                count += 1
        out.append((turn, (first or time.perf_counter()) - t0, count))
        messages.append({"role": "assistant", "content": "".join(text)})
        if turn < 2:
            messages.append({"role": "user", "content": QUESTIONS[turn + 1]})


def run(url: str, model: str, files: list[str], tokens: int) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    converse(client, model, "def f():\n    return 1\n", 8, [])  # warm-up, not counted
    results: list[tuple[int, float, int]] = []
    threads = [threading.Thread(target=converse, args=(client, model, f, tokens, results))
               for f in files]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if len(results) != 3 * len(files):
        raise RuntimeError(f"{3 * len(files) - len(results)} turns did not finish")
    return {"wall_s": wall, "tok_s": sum(r[2] for r in results) / wall,
            "ttft_first_p50": statistics.median(r[1] for r in results if r[0] == 0),
            "ttft_followup_p50": statistics.median(r[1] for r in results if r[0] > 0),
            "tokens": sum(r[2] for r in results)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--file-tokens", type=int, default=2500)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()
    n = args.conversations
    port = free_port()
    env = {**os.environ, "PORT": str(port), "KESTREL_MODEL": str(args.gguf),
           "KESTREL_LOG_LEVEL": "WARNING", "KESTREL_KV_CACHE_DTYPE": args.kv_cache_dtype}
    proc = subprocess.Popen([sys.executable, "-m", "kestrel.serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        files = source_files(url, model, n, args.file_tokens)
        ours = run(url, model, files, args.tokens)
    finally:
        stop(proc)
    print(f"ours ({args.kv_cache_dtype} cache): {json.dumps(ours)}", flush=True)
    theirs = None
    if args.llama_server is not None:
        port = free_port()
        ctx = n * (args.file_tokens + 4 * args.tokens + 400)
        proc = subprocess.Popen(
            [str(args.llama_server), "-m", str(args.gguf), "-t", str(args.threads), "-np",
             str(n), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc)
            theirs = run(url, "llama", files, args.tokens)
        finally:
            stop(proc)
        print(f"llama-server: {json.dumps(theirs)}", flush=True)
    print("\n| server | output tok/s | first-turn TTFT p50 (s) | follow-up TTFT p50 (s) | "
          "wall (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in (("kestrel", ours), ("llama-server", theirs)):
        if r is not None:
            print(f"| {name} | {r['tok_s']:.2f} | {r['ttft_first_p50']:.2f} | "
                  f"{r['ttft_followup_p50']:.2f} | {r['wall_s']:.1f} |")
    if theirs is not None:
        print(f"\nours / llama-server: tok/s {ours['tok_s'] / theirs['tok_s']:.2f}x, first-turn "
              f"TTFT {ours['ttft_first_p50'] / theirs['ttft_first_p50']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
