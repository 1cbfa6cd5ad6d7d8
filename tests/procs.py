"""Real processes for end-to-end tests: a gateway and workers on loopback, real ZeroMQ.

    with GatewayProc(...) as gw, WorkerProc(model_dir, gw.engine_address) as wk:
        gw.wait_ready(); ... HTTP to gw.base_url ...

Each process writes its JSON log lines to a file the test can read (`log_lines()`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    name = "proc"

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = Path(tempfile.mkstemp(prefix=f"kestrel-{self.name}-", suffix=".log")[1])
        self.popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        self._log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.args, env=self.env, cwd=ROOT, stdout=self._log,
                                      stderr=subprocess.STDOUT)
        return self

    def __enter__(self) -> Proc:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)

    def kill(self) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self, timeout: float = 15) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def only_error(self) -> str:
        """The message of the one ERROR line the process logged, which must be its only one,
        with no traceback anywhere in its output (how a refusal is said: one line)."""
        out = self.output()
        assert "Traceback" not in out, out[-3000:]
        errors = [json.loads(line) for line in out.splitlines()
                  if line.startswith("{") and '"ERROR"' in line]
        assert len(errors) == 1, out[-3000:]
        return errors[0]["msg"]

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for line in self.output().splitlines():
            if line.startswith("{"):
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    pass
        return lines


class GatewayProc(Proc):
    name = "gateway"

    def __init__(self, *flags: str, env: dict[str, str] | None = None,
                 python: str = sys.executable) -> None:
        self.port = free_port()
        self.engine_address = f"tcp://127.0.0.1:{free_port()}"
        self.base_url = f"http://127.0.0.1:{self.port}"
        # Loopback TCP without link keys must be asked for by name (issue 23).
        insecure = [] if "--link-secret-key" in flags else ["--insecure-link"]
        args = [python, "-m", "gateway.main", "--port", str(self.port),
                "--engine-address", self.engine_address, *insecure, *flags]
        super().__init__(args, env)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway not ready after {timeout} s:\n{self.output()[-3000:]}")

    def wait_live(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/health/live", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise TimeoutError(f"gateway not live:\n{self.output()[-3000:]}")

    def metrics(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=5).text


class WorkerProc(Proc):
    name = "worker"

    def __init__(self, model: str | Path, gateway_address: str, *flags: str,
                 env: dict[str, str] | None = None) -> None:
        args = [sys.executable, "-m", "engine_worker.main", "--model", str(model),
                "--gateway-address", gateway_address, "--kv-cache-mb", "64", *flags]
        super().__init__(args, env)

    def request_ends(self) -> dict[str, dict[str, Any]]:
        """The worker's per-request log lines, by engine request id."""
        return {e["request_id"]: e for e in self.log_lines() if e.get("event") == "request_end"}


def read_response(s: socket.socket) -> bytes:
    """One whole HTTP response (its head, then Content-Length bytes of body)."""
    got = b""
    while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < int(
            re.search(rb"content-length: (\d+)", got, re.I).group(1)):  # type: ignore[union-attr]
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


class throttled:  # noqa: N801 (a context manager, named for what the process is in it)
    """The process runs `run_s` of every `run_s + stop_s` seconds (SIGSTOP / SIGCONT from a
    thread) while in the block: a host slower than the one its step costs were measured on, for
    tests of a deadline the estimate missed. Each stop is far shorter than the heartbeat timeout."""

    def __init__(self, proc: Proc, run_s: float = 0.01, stop_s: float = 0.09) -> None:
        assert proc.popen is not None
        self.pid, self.run_s, self.stop_s = proc.popen.pid, run_s, stop_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._cycle, daemon=True)

    def _cycle(self) -> None:
        while not self._done.is_set():
            os.kill(self.pid, signal.SIGSTOP)
            self._done.wait(self.stop_s)
            os.kill(self.pid, signal.SIGCONT)
            self._done.wait(self.run_s)

    def __enter__(self) -> throttled:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        os.kill(self.pid, signal.SIGCONT)


def wait_outstanding_zero(gw: GatewayProc, timeout: float = 10) -> int:
    """The gateway's outstanding requests once they reach 0, or what they are at `timeout`."""
    deadline = time.monotonic() + timeout
    while (left := httpx.get(gw.base_url + "/health").json()["queue"]["outstanding"]) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def decode_step_s(gw: GatewayProc) -> float:
    """The one-row decode step the gateway's worker measured (its /metrics)."""
    for line in httpx.get(gw.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('kestrel_worker_decode_step_cost_seconds{rows="1"'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no decode step cost in /metrics")
