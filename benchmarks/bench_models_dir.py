"""`kestrel serve --models-dir` over SmolLM2 and the two Qwen2.5-Coder files (issue 39's scenario):
each model answers in turn, never more than --models-max loaded, the time from a request for an
unloaded model to its first token (cold: first start of the file on this host; warm: its blocks
and probe kept), each worker's RSS, and nothing left after the idle time.

    python benchmarks/bench_models_dir.py [--models-max 2] [--sleep-idle-seconds 30]

The folder is made of links to the embedded SmolLM2 GGUF and the Qwen files in the cache's gguf/
folder (`python benchmarks/fetch_qwen_gguf.py`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_vs_llamacpp import free_port, stop, wait_ready  # noqa: E402
from engine_worker.config import cache_dir_from_env  # noqa: E402
from engine_worker.model.loader import embedded_gguf_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FILES = {"smollm2": embedded_gguf_path(),
         "qwen-0.5b": cache_dir_from_env() / "gguf" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
         "qwen-1.5b": cache_dir_from_env() / "gguf" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}


def workers(serve: subprocess.Popen[bytes]) -> dict[int, int]:
    """pid -> RSS in bytes of each live worker process the server started."""
    out = {}
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes()
            status = (proc / "status").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == serve.pid and b"engine_worker.main" in cmd and state != "Z":
            rss = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS"))
            out[int(proc.name)] = rss * 1024
    return out


def first_token_s(url: str, model: str) -> tuple[float, str]:
    body = {"model": model, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0,
            "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - started, json.loads(line[6:])["model"]
    raise RuntimeError(f"no token from {model}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models-max", type=int, default=2)
    ap.add_argument("--sleep-idle-seconds", type=float, default=30.0)
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="kestrel-models-"))
    for name, path in FILES.items():
        if not path.is_file():
            raise SystemExit(f"{path} is not there (benchmarks/fetch_qwen_gguf.py)")
        (folder / f"{name}.gguf").symlink_to(path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [sys.executable, "-m", "kestrel.cli", "serve", "--models-dir", str(folder),
         "--models-max", str(args.models_max), "--sleep-idle-seconds",
         str(args.sleep_idle_seconds), "--port", str(port), "--kv-cache-mb", "256",
         "--log-level", "WARNING"], cwd=ROOT, env={**os.environ}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    result: dict[str, object] = {"models_max": args.models_max}
    try:
        wait_ready(url, serve)
        listed = httpx.get(url + "/v1/models").json()["data"]
        result["listed"] = {d["id"]: d["status"] for d in listed}
        turns, most = [], 0
        for model in ("smollm2", "qwen-0.5b", "qwen-1.5b", "smollm2", "qwen-0.5b", "qwen-1.5b"):
            seconds, answered = first_token_s(url, model)
            procs = workers(serve)
            most = max(most, len(procs))
            status = {d["id"]: d["status"] for d in httpx.get(url + "/v1/models").json()["data"]}
            turns.append({"model": model, "answered_by": answered,
                          "first_token_s": round(seconds, 2), "loaded": sorted(
                              m for m, s in status.items() if s == "loaded"),
                          "worker_rss_mib": sorted(round(r / 2**20) for r in procs.values())})
        result["turns"], result["most_workers_seen"] = turns, most
        time.sleep(args.sleep_idle_seconds + 3)
        result["after_idle"] = {"workers": len(workers(serve)), "statuses": sorted(
            {d["status"] for d in httpx.get(url + "/v1/models").json()["data"]})}
        print(json.dumps(result, indent=1))
    finally:
        stop(serve)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
