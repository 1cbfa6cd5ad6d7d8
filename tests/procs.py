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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on loopback now, never one this process handed out before: the kernel may
    give a just-closed port again at once, and a gateway once got its HTTP port equal to its
    engine link's (bind failed, `address already in use`)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class Forked:
    """Popen's surface (pid, args, returncode, poll, wait, send_signal, terminate, kill) for a
    process forked by the zygote (tests/zygote.py), which reaps it and writes its exit status
    beside its log."""

    def __init__(self, pid: int, args: list[str], rc_path: Path) -> None:
        self.pid, self.args, self.rc_path = pid, args, rc_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.rc_path.exists():
            self.returncode = int(self.rc_path.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The session's preloaded parent of `module`'s processes (tests/zygote.py), started at the
    first one; None where it cannot start (then they start as ordinary processes).
    KESTREL_TEST_ZYGOTE=0 turns it off."""

    _started: dict[str, Zygote | None] = {}

    def __init__(self, module: str) -> None:
        self.path = tempfile.mkdtemp(prefix="kestrel-zygote-") + "/sock"
        self.log = open(Path(self.path).with_suffix(".log"), "ab")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen([sys.executable, "-m", "tests.zygote", self.path, module],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self.log, cwd=ROOT, env=self.env)
        assert self.popen.stdout is not None
        if self.popen.stdout.readline().strip() != b"ready":
            raise RuntimeError("the zygote did not start")

    @classmethod
    def get(cls, module: str) -> Zygote | None:
        if module not in cls._started and os.environ.get("KESTREL_TEST_ZYGOTE") != "0":
            try:
                cls._started[module] = Zygote(module)
            except (OSError, RuntimeError):
                cls._started[module] = None
        return cls._started.get(module)

    def accepts(self, env: dict[str, str]) -> bool:
        from tests.zygote import import_time_env

        return import_time_env(env) == import_time_env(self.env)

    def spawn(self, args: list[str], env: dict[str, str], log_path: Path) -> Forked:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.path)
            s.sendall(json.dumps({"args": args, "env": env, "cwd": str(ROOT),
                                  "log": str(log_path)}).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    raise RuntimeError("the zygote closed the connection")
                reply += chunk
        return Forked(json.loads(reply)["pid"], args, Path(f"{log_path}.rc"))


class Proc:
    name = "proc"
    module = ""  # `python -m` module a zygote may fork instead of starting (tests/zygote.py)

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = Path(tempfile.mkstemp(prefix=f"kestrel-{self.name}-", suffix=".log")[1])
        self.popen: subprocess.Popen | Forked | None = None

    def start(self) -> Proc:
        self._log = open(self.log_path, "ab")
        zygote = Zygote.get(self.module) if self.module and self.args[:3] == [
            sys.executable, "-m", self.module] else None
        if zygote is not None and zygote.accepts(self.env):
            self.popen = zygote.spawn(self.args[3:], self.env, self.log_path)
            return self
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
    module = "gateway.main"

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
    module = "engine_worker.main"

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


def read_then_leave(gw: GatewayProc, path: str, body: dict[str, Any],
                    enough: Callable[[bytes], bool]) -> bytes:
    """POST `body` on a raw connection, read the streamed answer until `enough` of it came
    (each read of a 200), then close the connection: a client that goes away mid-stream.
    What it read."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        got = b""
        while not enough(got):
            chunk = s.recv(4096)
            assert chunk and b" 200 OK" in got + chunk, got + chunk
            got += chunk
    return got


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
