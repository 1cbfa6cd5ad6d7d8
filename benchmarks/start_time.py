"""Seconds from a worker's start to the gateway's /health/ready, and the worker's RSS then.

    python benchmarks/start_time.py TREE GGUF LABEL
    python benchmarks/start_time.py --llama-server PATH GGUF LABEL   (llama.cpp's, -t 2 -c 4096)

TREE: a checkout whose gateway and worker are run (this one, or a worktree of an older commit,
to compare both in one session); the interpreter is the one running this script. The worker
gets --kv-cache-mb 256 and the environment's cache dir (KESTREL_CACHE_DIR or ~/.cache/kestrel).
Prints one line: LABEL, the seconds, the worker's VmRSS, RssAnon and RssFile when ready.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_line(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return " ".join(" ".join(line.split()) for line in f
                        if line.startswith(("VmRSS", "RssAnon", "RssFile")))


def wait_ok(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    """Until `url` answers 200 (SystemExit if `proc` ends first). A light poll: the process
    timed has the two cores to itself."""
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited")
        time.sleep(0.25)


def llama(binary: str, gguf: str, label: str) -> int:
    """llama-server on the same file: seconds from its start to /health answering 200."""
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen([binary, "-m", gguf, "--port", str(port), "-t", "2", "-c", "4096"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ok(f"http://127.0.0.1:{port}/health", proc, "llama-server")
        print(label, f"ready after {time.monotonic() - started:.1f} s;", rss_line(proc.pid))
    finally:
        proc.kill()
        proc.wait(30)
    return 0


def main() -> int:
    if sys.argv[1] == "--llama-server":
        return llama(*sys.argv[2:5])
    tree, gguf, label = sys.argv[1:4]
    port = free_port()
    link = f"ipc://{tempfile.gettempdir()}/kestrel-start-{free_port()}"
    env = {**os.environ, "KESTREL_LOG_LEVEL": "WARNING"}
    quiet = {"cwd": tree, "env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    gw = subprocess.Popen([sys.executable, "-m", "gateway.main", "--port", str(port),
                           "--engine-address", link], **quiet)  # type: ignore[call-overload]
    time.sleep(3)
    if gw.poll() is not None:
        raise SystemExit("the gateway exited")
    started = time.monotonic()
    wk = subprocess.Popen([sys.executable, "-m", "engine_worker.main", "--model", gguf,
                           "--kv-cache-mb", "256", "--gateway-address", link],
                          **quiet)  # type: ignore[call-overload]
    try:
        wait_ok(f"http://127.0.0.1:{port}/health/ready", wk, "the worker")
        ready = time.monotonic() - started
        print(label, f"ready after {ready:.1f} s;", rss_line(wk.pid))
    finally:
        wk.kill()
        gw.terminate()
        wk.wait(30)
        gw.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
