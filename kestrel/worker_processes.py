"""The worker processes `kestrel serve --models-dir DIR` starts and stops for the gateway's
on-demand loading (gateway/engine/on_demand.py's Spawner).

    catalog(DIR): every GGUF file (its id: the file's name without the quantization suffix, as
        `kestrel serve FILE` names it) and every folder with a config.json (its name)
    start(id): `python -m engine_worker.main` with the serve command's worker settings, the
        model's path and id, in a process that dies with ours (kestrel/with_parent.py); its
        output goes to ours, the last error line kept
    stop(id): SIGTERM (the worker drains and exits; SIGKILL if it has not in its drain time)

A process that ends without being stopped is a model that failed to load: `failure` says why, in
the worker's own words (its last ERROR line), or its exit status.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from common.settings import settings_environ
from engine_worker.config import WorkerConfig
from engine_worker.naming import gguf_model_name
from kestrel import with_parent


def catalog(folder: Path) -> dict[str, str]:
    """Model id -> path for what the folder holds, sorted by id; ids that two files would share
    (one model in two quantizations) are the files' full stems instead."""
    found: list[tuple[str, Path]] = []
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and path.suffix == ".gguf":
            found.append((gguf_model_name(path), path))
        elif path.is_dir() and (path / "config.json").is_file():
            found.append((path.name, path))
    ids = [i for i, _ in found]
    named = {(i if ids.count(i) == 1 else p.name.removesuffix(".gguf")): p for i, p in found}
    return {i: str(named[i]) for i in sorted(named)}


class WorkerProcesses:
    def __init__(self, worker_cfg: WorkerConfig, models: dict[str, str]) -> None:
        self.worker_cfg = worker_cfg
        self.catalog = models
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()  # told to stop: its exit is no failure
        self.last_error: dict[str, str] = {}
        self.lock = threading.Lock()

    def start(self, model_id: str) -> None:
        cfg = dataclasses.replace(self.worker_cfg, model=self.catalog[model_id],
                                  model_id=model_id)
        env = {**os.environ, **settings_environ(cfg), **with_parent.environ()}
        with self.lock:
            self.stopped.discard(model_id)
            self.last_error.pop(model_id, None)
            # it dies with this process, however this one ends (kestrel/with_parent.py)
            proc = subprocess.Popen(with_parent.command("engine_worker.main"), env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.procs[model_id] = proc
        threading.Thread(target=self._relay, args=(model_id, proc), daemon=True,
                         name=f"worker-output-{model_id}").start()

    def _relay(self, model_id: str, proc: subprocess.Popen[bytes]) -> None:
        """The worker's output to ours, line by line; its ERROR lines remembered."""
        assert proc.stdout is not None
        for raw in proc.stdout:
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and line.get("level") == "ERROR":
                self.last_error[model_id] = str(line.get("msg") or line.get("message"))[:500]

    def running(self, model_id: str) -> bool:
        proc = self.procs.get(model_id)
        return proc is not None and proc.poll() is None

    def stop(self, model_id: str) -> None:
        proc = self.procs.get(model_id)
        if proc is None or proc.poll() is not None:
            return
        self.stopped.add(model_id)
        proc.terminate()
        grace = self.worker_cfg.drain_timeout_s + 5
        threading.Thread(target=_kill_after, args=(proc, grace), daemon=True).start()

    def failure(self, model_id: str) -> str | None:
        proc = self.procs.get(model_id)
        if proc is None or proc.poll() is None or model_id in self.stopped:
            return None
        error = self.last_error.get(model_id)
        return error or f"its worker exited with status {proc.returncode}"

    def stop_all(self, timeout_s: float) -> None:
        """SIGTERM to each, SIGKILL to those still there `timeout_s` after (one deadline for
        all, not one each)."""
        for model_id in list(self.procs):
            self.stop(model_id)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _kill_after(proc: subprocess.Popen[bytes], seconds: float) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
