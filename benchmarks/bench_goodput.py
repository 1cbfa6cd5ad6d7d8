"""Goodput under real load: N concurrent chats with a ShareGPT-like spread of prompt and answer
lengths, against llama.cpp's llama-server and ours on the same GGUF, one after the other.

    python benchmarks/bench_goodput.py [--llama-server PATH] [--gguf FILE] [--concurrency 16,64]
        [--requests-per-stream 2] [--slo-ttft-ms 10000] [--slo-tpot-ms 250] [--seed 0]

Data flow: a JSONL workload is drawn once (--seed): prompt lengths log-normal around 250 tokens
clipped to 50..1,000, answer lengths log-normal around 128 clipped to 16..256 (the shape of
ShareGPT's first turns, which `vllm bench serve` uses); every server gets the same rows. For
each server (llama-server first, if given, then ours with its defaults): start it on loopback,
wait until ready, run `kestrel-loadgen run --api chat --mode closed` at each concurrency
(concurrency x --requests-per-stream requests, ignore_eos, streamed, no client timeout below
1 h), stop it. Printed per server and concurrency: requests finished with all their tokens,
output tok/s, TTFT and ITL p50/p99, and goodput: the share of requests that finished with a
TTFT and a mean inter-token time (TPOT) within the targets. llama-server gets one slot per
stream (-np) and the context they need; ours runs as `kestrel serve` with default flags.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_vs_llamacpp import free_port, start_ours, stop, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def workload(path: Path, rows: int, seed: int) -> tuple[float, float]:
    """Write `rows` JSONL rows of prompt_len / output_len; their mean lengths."""
    rng = random.Random(seed)

    def draw(median: float, sigma: float, low: int, high: int) -> int:
        return max(low, min(high, round(math.exp(rng.gauss(math.log(median), sigma)))))

    lines = [{"prompt_len": draw(250, 0.8, 50, 1000), "output_len": draw(128, 0.6, 16, 256)}
             for _ in range(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return (sum(r["prompt_len"] for r in lines) / rows, sum(r["output_len"] for r in lines) / rows)


def start_llama(binary: Path, gguf: Path, slots: int, threads: int,
                port: int) -> subprocess.Popen[bytes]:
    ctx = slots * (1000 + 256 + 128)  # each slot's share: the longest prompt, answer, template
    return subprocess.Popen(
        [str(binary), "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(ctx),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_load(url: str, concurrency: int, requests: int, dataset: Path, tokenizer: Path,
             args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run(
            [sys.executable, "-m", "loadgen.cli", "run", "--base-url", url + "/v1",
             "--api", "chat", "--mode", "closed", "--concurrency", str(concurrency),
             "--num-requests", str(requests), "--dataset", str(dataset),
             "--tokenizer-json", str(tokenizer), "--seed", str(args.seed),
             "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
             "--timeout", "3600", "--no-keepalive", "--no-progress", "--no-records",
             "--out", str(out)],
            cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        data = json.loads(out.read_text())
    return data.get("summary", data)


def row(s: dict) -> dict[str, float]:
    nan = float("nan")
    n = s["num_requests"] or 1
    return {"finished": s["completed"], "asked": s["num_requests"],
            "tok_s": s["output_throughput"] or nan,
            "ttft_p50": s["ttft"]["p50"] or nan, "ttft_p99": s["ttft"]["p99"] or nan,
            "itl_p50": s["itl"]["p50"] or nan, "itl_p99": s["itl"]["p99"] or nan,
            "goodput": (s["goodput"] or 0.0) * s["duration_s"] / n,
            "duration_s": s["duration_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--gguf", type=Path, default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--concurrency", default="16,64",
                    type=lambda v: [int(x) for x in v.split(",") if x])
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--slo-ttft-ms", type=float, default=10_000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=250.0)
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from engine_worker.config import cache_dir_from_env
    from engine_worker.model.loader import embedded_gguf_path, resolve_checkpoint

    gguf = args.gguf or embedded_gguf_path()
    tokenizer = resolve_checkpoint(str(gguf), cache_dir_from_env(), weights=False) / \
        "tokenizer.json"
    servers = ["ours"]
    if args.llama_server is not None and args.llama_server.is_file():
        servers.insert(0, "llama-server")
    else:
        print("llama-server: skipped (no --llama-server binary given)", flush=True)
    results: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "workload.jsonl"
        most = max(args.concurrency) * args.requests_per_stream
        mean_in, mean_out = workload(dataset, most, args.seed)
        print(f"workload: {most} rows, mean prompt {mean_in:.0f} tokens, mean answer "
              f"{mean_out:.0f} tokens", flush=True)
        for name in servers:
            for c in args.concurrency:  # a fresh server per point: no warm prefix cache
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                proc = start_llama(args.llama_server, gguf, c, args.threads, port) \
                    if name == "llama-server" else start_ours("auto", args.gguf, port)
                try:
                    t0 = time.monotonic()
                    wait_ready(url, proc)
                    print(f"{name} at {c}: ready in {time.monotonic() - t0:.0f} s", flush=True)
                    results[(name, c)] = r = row(run_load(url, c, c * args.requests_per_stream,
                                                          dataset, tokenizer, args))
                    print(f"  {name} at {c}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()),
                          flush=True)
                finally:
                    stop(proc)
    print("\n| server | streams | finished | output tok/s | TTFT p50 / p99 (ms) | "
          "ITL p50 / p99 (ms) | goodput |")
    print("|---|---|---|---|---|---|---|")
    for (name, c), r in results.items():
        print(f"| {name} | {c} | {r['finished']:.0f} of {r['asked']:.0f} | {r['tok_s']:.1f} | "
              f"{r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} | {r['itl_p50']:.0f} / "
              f"{r['itl_p99']:.0f} | {r['goodput']:.0%} |")
    print(f"\n{gguf.name}; goodput: finished with TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= "
          f"{args.slo_tpot_ms:g} ms; chats, ignore_eos, closed loop, "
          f"{args.requests_per_stream} requests a stream")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
