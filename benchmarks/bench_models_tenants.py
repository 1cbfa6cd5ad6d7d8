"""Tenants contending for `kestrel serve --models-dir` (issue 58): N tenants over M models, each
tenant a closed loop of chats to its own model (tenant t asks model t mod M) for a while, under
--models-max; prints the loads and unloads the server made, and per tenant its answers by
status and its latency p50/p99.

    python benchmarks/bench_models_tenants.py [--tenants 2] [--models 2] [--models-max 1]
        [--seconds 30] [--timeout 60] [--model-path DIR_OR_GGUF]

The models are links to one checkpoint (by default the tests' tiny random Llama in the cache,
made by the test suite's `tiny_model_dir` fixture): what is measured is the swapping, not the
model. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_vs_llamacpp import free_port, stop, wait_ready  # noqa: E402
from engine_worker.config import cache_dir_from_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def tenant(url: str, model: str, until: float, timeout: float, out: list[tuple[int, float]]
           ) -> None:
    body = {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}], "timeout": timeout}
    with httpx.Client(timeout=timeout + 30) as http:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                status = http.post(url + "/v1/chat/completions", json=body).status_code
            except httpx.HTTPError:
                status = 0
            out.append((status, time.monotonic() - started))


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", type=int, default=2)
    ap.add_argument("--models", type=int, default=2)
    ap.add_argument("--models-max", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--timeout", type=float, default=60.0, help="each request's deadline")
    ap.add_argument("--model-path", type=Path, default=cache_dir_from_env() / "tiny-llama-seed0")
    args = ap.parse_args(argv)
    if not args.model_path.exists():
        raise SystemExit(f"{args.model_path} is not there (the test suite makes the tiny model)")
    folder = Path(tempfile.mkdtemp(prefix="kestrel-tenants-"))
    suffix = ".gguf" if args.model_path.suffix == ".gguf" else ""
    names = [f"model-{k}" for k in range(args.models)]
    for name in names:
        (folder / f"{name}{suffix}").symlink_to(args.model_path.resolve())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [sys.executable, "-m", "kestrel.cli", "serve", "--models-dir", str(folder),
         "--models-max", str(args.models_max), "--port", str(port), "--threads", "1",
         "--kv-cache-memory", "16MiB", "--log-level", "WARNING"], cwd=ROOT, env={**os.environ},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, serve)
        until = time.monotonic() + args.seconds
        answers: list[list[tuple[int, float]]] = [[] for _ in range(args.tenants)]
        threads = [threading.Thread(target=tenant, args=(
            url, names[t % args.models], until, args.timeout, answers[t]))
            for t in range(args.tenants)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        text = httpx.get(url + "/metrics", timeout=10).text
        unloads = sum(metric(text, f'kestrel_model_unloads_total{{reason="{r}"}}')
                      for r in ("lru", "idle", "manual"))
        result = {"tenants": args.tenants, "models": args.models, "models_max": args.models_max,
                  "seconds": args.seconds, "loads": int(metric(text, "kestrel_model_loads_total")),
                  "unloads": int(unloads), "per_tenant": []}
        for t, got in enumerate(answers):
            ok = [s for status, s in got if status == 200]
            statuses: dict[str, int] = {}
            for status, _ in got:
                statuses[str(status)] = statuses.get(str(status), 0) + 1
            result["per_tenant"].append({  # type: ignore[union-attr]
                "tenant": t, "model": names[t % args.models], "requests": len(got),
                "statuses": statuses, "p50_s": percentile(ok, 0.5), "p99_s": percentile(ok, 0.99)})
        print(json.dumps(result, indent=1))
    finally:
        stop(serve)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
