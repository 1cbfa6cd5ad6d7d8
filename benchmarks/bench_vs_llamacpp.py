"""llama.cpp's llama-server against ours, same GGUF, same streaming load, alternating in one run.

    python benchmarks/bench_vs_llamacpp.py [--llama-server PATH] [--gguf FILE] [--rounds 2]
        [--ours auto,float32,int4,auto+compile,auto+dense4,auto+nostack] [--streams 1,16]
        [--requests-1 4] [--requests-16 32] [--prompt 200] [--neighbour]

Data flow: for each round, for each server (llama-server if a binary is given, then ours in
each mode of --ours; the order flips every round so neither always runs on a warmer machine):
start it on loopback, wait until ready, run `kestrel-loadgen run` in closed loop at 1 and at 16
streams (unique synthetic ~200-token prompts cut with SmolLM2's tokenizer, 128 new tokens,
ignore_eos, completions API), then 16 prompts of 128 tokens at once with one new token each
(prefill tokens/s: their prompt tokens over the run's time), stop it. Then print the table of
the issue: ITL p50 at 1 stream, output tok/s at 1 and 16 streams, TTFT p50 at 1 stream, prefill
tokens/s (the median over rounds of each figure).
Without --llama-server its column is skipped, with a message saying so. A mode's "+compile"
adds --compile decode, "+denseN" pins --dense-min-rows N (the measured choice otherwise),
"+nostack" runs decode rows layer by layer in Python (--decode-stack off).
--neighbour keeps one core busy (a process spinning, pinned to CPU 0) for the whole run: a host
shared with other work.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPT, OUTPUT = 200, 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_llama(binary: Path, gguf: Path, threads: int, port: int,
                prompt: int = PROMPT) -> subprocess.Popen[bytes]:
    ctx = 16 * (prompt + OUTPUT + 64)  # -np 16 splits the context between the slots
    return subprocess.Popen(
        [str(binary), "-m", str(gguf), "-t", str(threads), "-np", "16", "-c", str(ctx),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_ours(mode: str, gguf: Path | None, port: int) -> subprocess.Popen[bytes]:
    """mode: a --dtype (auto, float32, ...) or int8/int4 (--quantization, float32 activations),
    with "+compile" for --compile decode (e.g. auto+compile), "+denseN" for --dense-min-rows N,
    "+nostack" for --decode-stack off."""
    mode, *extras = mode.split("+")
    dense = next((x.removeprefix("dense") for x in extras if x.startswith("dense")), "-1")
    quant = mode if mode in ("int8", "int4") else "none"
    env = {**os.environ, "PORT": str(port), "KESTREL_DTYPE": "auto" if quant != "none" else mode,
           "KESTREL_QUANTIZATION": quant,
           "KESTREL_COMPILE": "decode" if "compile" in extras else "off",
           "KESTREL_DENSE_MIN_ROWS": dense,
           "KESTREL_DECODE_STACK": "off" if "nostack" in extras else "auto",
           "KESTREL_LOG_LEVEL": "WARNING",
           "KESTREL_MODEL": str(gguf) if gguf else "default"}
    return subprocess.Popen([sys.executable, "-m", "kestrel.serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        for path in ("/health/ready", "/health"):
            try:
                if httpx.get(url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def load(url: str, streams: int, requests: int, tokenizer: Path, seed: int,
         prompt: int = PROMPT, output: int = OUTPUT) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run(
            [sys.executable, "-m", "loadgen.cli", "run", "--base-url", url + "/v1",
             "--mode", "closed", "--concurrency", str(streams), "--num-requests", str(requests),
             "--prompt-len", f"fixed:{prompt}", "--output-len", f"fixed:{output}",
             "--tokenizer-json", str(tokenizer), "--seed", str(seed),
             # a new connection per request for both servers: llama-server closes idle
             # keep-alive connections as the client reuses them (a third of requests failed)
             "--timeout", "600", "--no-keepalive", "--no-progress", "--no-records",
             "--out", str(out)],
            cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        data = json.loads(out.read_text())
    return data.get("summary", data)


def measure(name: str, proc: subprocess.Popen[bytes], url: str, args: argparse.Namespace,
            tokenizer: Path, seed: int) -> dict[str, float]:
    try:
        t0 = time.monotonic()
        wait_ready(url, proc)
        print(f"  {name}: ready in {time.monotonic() - t0:.0f} s", flush=True)
        load(url, 1, 1, tokenizer, seed + 7, args.prompt)  # warm-up, not counted
        one = load(url, 1, args.requests_1, tokenizer, seed, args.prompt)
        none = {"p50": None, "p99": None}
        many = load(url, 16, args.requests_16, tokenizer, seed + 1, args.prompt) \
            if 16 in args.streams else {"output_throughput": None, "num_requests": 0,
                                        "completed": 0, "itl": none, "ttft": none}
        # prefill: 16 prompts of 128 tokens at once, one new token each
        pre = load(url, 16, 16, tokenizer, seed + 2, prompt=128, output=1)
    finally:
        stop(proc)
    nan = float("nan")  # a figure with no samples (every request failed) is null in the JSON
    row = {"itl_p50_1": one["itl"]["p50"] or nan, "tok_s_1": one["output_throughput"] or nan,
           "tok_s_16": many["output_throughput"] or nan, "ttft_p50_1": one["ttft"]["p50"] or nan,
           "itl_p50_16": many["itl"]["p50"] or nan, "itl_p99_16": many["itl"]["p99"] or nan,
           "ttft_p50_16": many["ttft"]["p50"] or nan,
           "finished_16": float(many["completed"]),
           "prefill_16x128": pre["prompt_tokens"] / pre["duration_s"] if pre["completed"] == 16
           else nan,
           "failed": float(one["num_requests"] - one["completed"]
                           + many["num_requests"] - many["completed"])}
    print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary")
    ap.add_argument("--gguf", type=Path, default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--ours", default="auto,float32,int4",
                    help="ours to run: --dtype values, or int8/int4 for --quantization")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--streams", default="1,16", type=lambda v: {int(x) for x in v.split(",")},
                    help="1,16 or 1: skip the 16-stream load (a compiled worker would compile a "
                         "graph per batch size on the way, minutes each)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--requests-1", type=int, default=4)
    ap.add_argument("--requests-16", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens of each request")
    ap.add_argument("--neighbour", action="store_true",
                    help="a process keeps CPU 0 busy for the whole run")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from engine_worker.model.loader import embedded_gguf_path, resolve_checkpoint

    gguf = args.gguf or embedded_gguf_path()
    from engine_worker.config import cache_dir_from_env
    cache = cache_dir_from_env()
    tokenizer = resolve_checkpoint(str(gguf), cache, weights=False) / "tokenizer.json"
    modes = {f"ours {d}": d for d in args.ours.split(",") if d}
    servers: list[str] = list(modes)
    if args.llama_server is None:
        print("llama-server: skipped (no --llama-server PATH given)", flush=True)
    elif not args.llama_server.is_file():
        print(f"llama-server: skipped ({args.llama_server} is not a file)", flush=True)
    else:
        servers.insert(0, "llama-server")
    results: dict[str, list[dict[str, float]]] = {s: [] for s in servers}
    neighbour = subprocess.Popen(  # spins on CPU 0 until killed
        [sys.executable, "-c", "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"]
    ) if args.neighbour else None
    try:
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            for name in (servers if r % 2 == 0 else servers[::-1]):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                if name == "llama-server":
                    proc = start_llama(args.llama_server, gguf, args.threads, port, args.prompt)
                else:
                    proc = start_ours(modes[name], args.gguf, port)
                results[name].append(measure(name, proc, url, args, tokenizer, seed=r * 10))
    finally:
        if neighbour is not None:
            neighbour.kill()
    rows = (("ITL p50 at 1 stream (ms)", "itl_p50_1"), ("output tok/s, 1 stream", "tok_s_1"),
            ("output tok/s, 16 streams", "tok_s_16"), ("TTFT p50, 1 stream (ms)", "ttft_p50_1"),
            ("ITL p50, 16 streams (ms)", "itl_p50_16"), ("ITL p99, 16 streams (ms)", "itl_p99_16"),
            ("TTFT p50, 16 streams (ms)", "ttft_p50_16"),
            (f"requests finished with all tokens, 16 streams (of {args.requests_16})",
             "finished_16"),
            ("prefill tok/s, 16 x 128-token prompts at once", "prefill_16x128"),
            ("failed requests", "failed"))
    print("\n| | " + " | ".join(servers) + " |")
    print("|---" * (len(servers) + 1) + "|")
    for label, key in rows:
        cells = [f"{statistics.median(x[key] for x in results[s]):.1f}" for s in servers]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\n{gguf.name}, prompts {args.prompt} tokens (unique), {OUTPUT} new tokens, ignore_eos, "
          f"closed loop; {args.requests_1} requests at 1 stream, {args.requests_16} at 16; "
          f"median of {args.rounds} round(s)"
          + ("; a neighbour process kept CPU 0 busy throughout" if args.neighbour else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
