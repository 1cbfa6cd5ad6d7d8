"""A preloaded parent for the tests' worker and gateway processes: one per module run, its
imports done once per test session, each process forked from it (issue 37).

A worker's start was ~1.7 s on the 2-core hosts, 1.4 s of it imports (torch 1.26 s), a
gateway's 0.5 s; the suite starts ~80 of each. A fork of this process starts one in a few
milliseconds, the rest is the process's own work (a worker's model, probe and Hello). The
gateway's zygote never imports torch (the gateway runs without it, and a test checks that).

    tests.procs.Proc.start ──request (args, env, cwd, log path) over a Unix socket──▶ here
        fork: the child points stdout/stderr at the log, takes the request's environment and
        working folder, reseeds, and runs the module (`engine_worker.main` or `gateway.main`)
        as `python -m` would
        ◀── its pid; when it ends, its exit status in `<log>.rc` (written by this process,
            which reaps it: tests.procs.Forked reads it as Popen's returncode)
    stdin closed (the test session ended) ──▶ exits

Only a request whose environment agrees with this process's on every variable read when torch
or a runtime under it loads (ISA caps, thread counts, allocators) is forked; the others start as
ordinary processes (tests.procs decides). This process stays single-threaded and runs no torch
op, so a child inherits no thread pool and no lock held by another thread.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import select
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

# Read by torch or a runtime under it (OpenMP, MKL, oneDNN) as they load, or by the allocator:
# a child with other values would not get them. Such a request is not forked here.
IMPORT_TIME_PREFIXES = ("ATEN_", "ONEDNN_", "DNNL_", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH",
                        "PYTORCH", "LD_", "MALLOC", "KESTREL_CPU_ISA", "CUDA", "PYTHON")
# Read when used, not as torch loads: the child's own value holds (PYTHONUNBUFFERED: by each
# interpreter, which a fork does not restart; Inductor's cache folder: at each compile).
FORK_SAFE = {"PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR"}
PRELOADS = {
    "engine_worker.main": ("torch", "engine_worker.engine", "engine_worker.grammar",
                           "engine_worker.link", "engine_worker.link_set", "engine_worker.main",
                           "engine_worker.model.tokenizer", "engine_worker.model_runner",
                           "engine_worker.speculative.build"),
    "gateway.main": ("gateway.main", "gateway.api.app", "uvicorn", "httptools"),
}


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_TIME_PREFIXES) and k not in FORK_SAFE}


def preload(module: str) -> None:
    for name in PRELOADS[module]:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional one (httptools): the child imports what it needs
            pass


def _child(module: str, request: dict[str, Any]) -> int:
    """In the forked child: become the worker the request names; its exit status."""
    # Signal dispositions stay this interpreter's own, which are a new one's (SIGPIPE ignored,
    # SIGINT as KeyboardInterrupt): this process never changes them.
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # each child its own draws, as a new process would have
    import numpy as np

    np.random.seed()
    sys.argv = [module, *request["args"]]
    try:  # what `python -m module` runs: its main() (imported here already)
        return importlib.import_module(module).main() or 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # as the interpreter would: the trace, then status 1
        traceback.print_exc()
        return 1


def _reap(children: dict[int, str]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        rc_path = children.pop(pid, None)
        if rc_path is not None:
            tmp = f"{rc_path}.tmp"
            Path(tmp).write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(tmp, rc_path)  # whole or absent


def serve(path: str, module: str) -> None:
    preload(module)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    children: dict[int, str] = {}
    while True:
        ready, _, _ = select.select([server, sys.stdin], [], [], 0.01)
        _reap(children)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            for pid in children:  # the session is over: nothing of it may outlive it
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        if server not in ready:
            continue
        conn, _ = server.accept()
        with conn:
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                code = 1
                try:
                    code = _child(module, request)
                finally:
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                    finally:
                        os._exit(code)
            children[pid] = request["log"] + ".rc"
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
