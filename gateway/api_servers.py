"""More than one gateway process on one port, when one event loop is not enough (as vLLM's
`--api-server-count`).

    kestrel-gateway --api-server-count K --port P --engine-address tcp://H:E
      process 0 ──starts──▶ processes 1..K-1 (the same settings, its index, the shared file)
      every process: HTTP on P through its own SO_REUSEPORT socket (the kernel spreads the
          connections), its own engine link at link_address(E, i) = tcp://H:E+i (ipc: PATH.i)
      every worker: joins all K links (--gateway-address with the K addresses, comma-separated)
          and announces 1/K of its max_num_seqs on each, so the K admit together what one would
      shared: the per-client rate limit (gateway.admission.shared_limits: buckets in one file, all
      map it) split: max_queue and a fixed max_outstanding, 1/K each
      per process: /metrics and /health (a scrape through P sees one process's figures)

Process 0 forwards SIGTERM/SIGINT to the others (each drains as one gateway would) and waits for
them; each child dies with process 0 (PR_SET_PDEATHSIG), so none is left serving alone, and a
child that dies on its own (kill -9, a crash) is started again by process 0, logged.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common.settings import settings_environ
from gateway.config import GatewayConfig

PR_SET_PDEATHSIG = 1
log = logging.getLogger("kestrel.gateway")


def link_address(address: str, index: int) -> str:
    """Process `index`'s engine link: the port + index (tcp), or the path + ".index" (ipc)."""
    if index == 0:
        return address
    if address.startswith("tcp://"):
        host, _, port = address.rpartition(":")
        return f"{host}:{int(port) + index}"
    return f"{address}.{index}"


def all_link_addresses(cfg: GatewayConfig) -> list[str]:
    """What a worker passes as --gateway-address to join every process."""
    return [link_address(cfg.engine_address, i) for i in range(cfg.api_server_count)]


def own_share(cfg: GatewayConfig) -> GatewayConfig:
    """This process's config: its engine link, and its 1/K of the queue and the fixed limit."""
    k = cfg.api_server_count
    if k == 1:
        return cfg
    return dataclasses.replace(
        cfg, engine_address=link_address(cfg.engine_address, cfg.api_server_index),
        max_queue=math.ceil(cfg.max_queue / k),
        max_outstanding=math.ceil(cfg.max_outstanding / k) if cfg.max_outstanding else 0)


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, shared with the other processes through SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# Looked up before any fork: the child, between fork and exec, only makes the call.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Children:
    """Processes 1..K-1, started by process 0, and started again when one dies on its own (a
    kill -9, a crash): its share of the port's connections would otherwise go nowhere while
    /health, answered by the others, said ok. Logged, and counted in `restarts`."""

    WATCH_S = 0.5  # how often the watcher looks
    MIN_LIFE_S = 5.0  # a process that dies sooner than this is restarted no sooner than this

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.procs: list[subprocess.Popen] = []
        self.started: list[float] = []
        self.restarts = 0
        fd, path = tempfile.mkstemp(prefix="kestrel-limits-", dir=_shm_dir())
        os.close(fd)
        self.shared_state = path
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def _spawn(self, i: int) -> subprocess.Popen:
        child = dataclasses.replace(self.cfg, api_server_index=i, shared_state=self.shared_state)
        env = {**os.environ, **settings_environ(child)}
        return subprocess.Popen([sys.executable, "-m", "gateway.main"], env=env,
                                preexec_fn=_die_with_parent)

    def start(self) -> None:
        for i in range(1, self.cfg.api_server_count):
            self.procs.append(self._spawn(i))
            self.started.append(time.monotonic())
        threading.Thread(target=self._watch, name="api-server-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.wait(self.WATCH_S):
            with self._lock:
                for j, proc in enumerate(self.procs):
                    code = proc.poll()
                    if code is None or self._stopping.is_set():
                        continue
                    if time.monotonic() - self.started[j] < self.MIN_LIFE_S:
                        continue  # dying at once: wait, so a broken start cannot spin
                    log.error("API server process %d exited with status %s: starting it "
                              "again", j + 1, code)
                    self.procs[j] = self._spawn(j + 1)
                    self.started[j] = time.monotonic()
                    self.restarts += 1

    def signal(self, sig: int) -> None:
        self._stopping.set()  # from here on an exit is wanted
        with self._lock:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(sig)

    def wait(self, timeout: float) -> None:
        self._stopping.set()
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        Path(self.shared_state).unlink(missing_ok=True)


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
