"""`kestrel serve [MODEL] [flags]` (and `kestrel-serve`): the gateway and one worker on this host,
or, with `--models-dir DIR`, the gateway and a worker per model of the folder, each started by
its first request (kestrel/worker_processes.py, gateway/engine/on_demand.py).

    argv ──one parser built from GatewayConfig and WorkerConfig──▶ both configs, validated here
      ──▶ worker: a child process handed its config as KESTREL_* variables (--models-dir: MODEL,
          if given, started at once; the others when asked for)
      ──▶ gateway: runs in this process until SIGTERM/SIGINT; then the workers are stopped

The flags are the two processes' own settings fields, grouped by process in --help, so a field
either process gains is a `kestrel serve` flag with no change here. A field both processes have
with one meaning (SHARED) is one flag for both; any other name they share gets a `--gateway-` and
a `--worker-` flag, so nothing is silently set for the wrong process. The worker's
`gateway_address` is the gateway's `engine_address`. A flag neither process has exits 2 naming
it; a vLLM flag kestrel does not take exits 2 saying why (kestrel/vllm_flags.py).

The link: unless --engine-address is given, the two processes talk over an `ipc://` socket in a
directory only this user can open (0700, checked at start), so no other local process can join
as a worker, read prompts or write answers, as it could on a keyless loopback TCP port.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import stat
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from common.settings import add_settings, env_name, new_parser, settings_environ, settings_from
from engine_worker.config import WorkerConfig
from engine_worker.naming import gguf_model_name
from gateway.api_servers import all_link_addresses
from gateway.config import GatewayConfig
from gateway.main import run
from kestrel import with_parent
from kestrel.vllm_flags import unsupported_reason
from kestrel.worker_processes import WorkerProcesses, catalog

log = logging.getLogger("kestrel.serve")

SHARED = ("log_level", "drain_timeout_s")  # the same meaning in both processes
SET_HERE = ("gateway_address",)  # the worker's; serve points it at its own gateway
GATEWAY_ENV = {"port": "PORT"}
WORKERS_EXIT_S = 4.0  # --models-dir: after the gateway's drain, how long workers get to exit


def _names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _all_but(cls: type, keep: set[str]) -> list[str]:
    return sorted(_names(cls) - keep)


def build_parser(prog: str = "kestrel serve") -> argparse.ArgumentParser:
    parser = new_parser(prog, "Serve a model: the HTTP gateway and one engine worker on this "
                              "host, configured together. Every flag is also a KESTREL_<NAME> "
                              "environment variable.",
                        usage="%(prog)s [MODEL] [flags]   (--help: the flags, by process)")
    gw, wk = _names(GatewayConfig), _names(WorkerConfig)
    clash = (gw & wk) - set(SHARED)
    model = parser.add_argument_group("model")
    model.add_argument("model_arg", nargs="?", metavar="MODEL",
                       help="the model: same as --model (give one or the other)")
    add_settings(model, WorkerConfig, dest_prefix="worker.", skip=_all_but(WorkerConfig, {"model"}))
    both = parser.add_argument_group("both processes")
    add_settings(both, GatewayConfig, dest_prefix="shared.",
                 skip=_all_but(GatewayConfig, set(SHARED)))
    gateway = parser.add_argument_group("gateway (HTTP API, admission, auth)")
    add_settings(gateway, GatewayConfig, dest_prefix="gateway.", extra_env=GATEWAY_ENV,
                 skip=[*SHARED, *clash])
    add_settings(gateway, GatewayConfig, dest_prefix="gateway.", flag_prefix="gateway-",
                 skip=_all_but(GatewayConfig, clash))
    worker = parser.add_argument_group("worker (model, KV cache, batching)")
    add_settings(worker, WorkerConfig, dest_prefix="worker.",
                 skip=[*SHARED, *clash, *SET_HERE, "model"])
    add_settings(worker, WorkerConfig, dest_prefix="worker.", flag_prefix="worker-",
                 skip=_all_but(WorkerConfig, clash - set(SET_HERE)))
    return parser


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _reject_extra(parser: argparse.ArgumentParser, extra: Sequence[str]) -> None:
    """Name the first flag we do not take (saying why for a vLLM one), else the stray word."""
    for token in extra:
        if token.startswith("-") and token != "-":
            name = token.split("=", 1)[0]
            reason = unsupported_reason(name)
            if reason is not None:
                _fail(parser, f"{name} is a vLLM flag kestrel does not support: {reason}")
            _fail(parser, f"unrecognized argument {name} (see {parser.prog} --help)")
    if extra:
        _fail(parser, f"unexpected argument {extra[0]!r}: MODEL was already given")


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, *,
          prog: str = "kestrel serve") -> tuple[GatewayConfig, WorkerConfig]:
    environ = os.environ if environ is None else environ
    parser = build_parser(prog)
    args, extra = parser.parse_known_args(argv)
    _reject_extra(parser, extra)
    names = getattr(args, "worker.model_id") or []
    if args.model_arg is None and getattr(args, "worker.model") is None and names and (
            names[-1].endswith(".gguf") or Path(names[-1]).exists()):
        # --served-model-name takes one or more values (as vLLM's does): a MODEL after it
        # would silently become an alias and the default model be served.
        _fail(parser, f"{names[-1]!r} was read as a --served-model-name; give MODEL before "
                      "--served-model-name, or as --model")
    if args.model_arg is not None:
        if getattr(args, "worker.model") is not None:
            _fail(parser, "give the model once: as MODEL or as --model, not both")
        setattr(args, "worker.model", args.model_arg)
    for name in SHARED:
        value = getattr(args, "shared." + name)
        setattr(args, "gateway." + name, value)
        setattr(args, "worker." + name, value)

    def error(message: str) -> NoReturn:
        _fail(parser, message)

    fixed = {}
    given = getattr(args, "gateway.engine_address") is not None
    if not given and env_name("engine_address") not in environ:
        port = (getattr(args, "gateway.port") or environ.get(env_name("port"))
                or environ.get("PORT") or "8000")
        fixed["engine_address"] = f"ipc://{link_dir(environ) / f'engine-{port}.sock'}"
    gateway = settings_from(GatewayConfig, args, environ, error, dest_prefix="gateway.",
                            extra_env=GATEWAY_ENV, fixed=fixed)
    problem = gateway.link_problem()
    if problem is not None:
        error(problem)
    # Every API server process has a link of its own: the worker joins them all (process 0's
    # alone left the others with no worker, and their share of requests got 503).
    worker = settings_from(WorkerConfig, args, environ, error, dest_prefix="worker.",
                           fixed={"gateway_address": ",".join(all_link_addresses(gateway))})
    return gateway, worker


def link_dir(environ: Mapping[str, str]) -> Path:
    """Where the one-host link's socket lives: the user's runtime directory when there is one
    (systemd makes it 0700), else a per-user folder in the temporary directory."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "kestrel"
    return Path(tempfile.gettempdir()) / f"kestrel-{os.getuid()}"


def private_dir(path: Path) -> None:
    """Make `path` a directory only this user can enter; refuse one another user owns (it could
    hold a socket someone else put there) or one this user cannot make private."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise SystemExit(f"kestrel serve: {path} is not a directory of this user's: refusing to "
                         "put the engine link there (give --engine-address)")
    if stat.S_IMODE(info.st_mode) & 0o077:
        path.chmod(0o700)


def _watch(worker: subprocess.Popen, stopping: threading.Event) -> None:
    """A worker that exits on its own (a model that does not load...) ends the server too:
    a gateway with no worker would only answer 503."""
    code = worker.wait()
    if not stopping.is_set():
        log.error("the worker exited with status %s; stopping the gateway", code)
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str] | None = None, *, prog: str = "kestrel serve") -> int:
    gateway_cfg, worker_cfg = parse(argv, prog=prog)
    if gateway_cfg.engine_address.startswith("ipc://"):
        private_dir(Path(gateway_cfg.engine_address.removeprefix("ipc://")).parent)
    if gateway_cfg.models_dir:
        return serve_folder(gateway_cfg, worker_cfg, argv)
    env = {**os.environ, **settings_environ(worker_cfg), **with_parent.environ()}
    worker = subprocess.Popen(with_parent.command("engine_worker.main"), env=env)
    stopping = threading.Event()
    threading.Thread(target=_watch, args=(worker, stopping), daemon=True,
                     name="worker-watch").start()
    try:
        run(gateway_cfg)
    finally:
        stopping.set()
        if worker.poll() is None:
            worker.terminate()
        try:
            worker.wait(timeout=gateway_cfg.drain_timeout_s + 5)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    return 1 if worker.returncode not in (0, -signal.SIGTERM) else 0


def serve_folder(gateway_cfg: GatewayConfig, worker_cfg: WorkerConfig,
                 argv: Sequence[str] | None) -> int:
    """--models-dir: the gateway with a worker per model, started on demand; MODEL (when given
    on the command line) at once."""
    if gateway_cfg.api_server_count > 1:
        raise SystemExit("kestrel serve: --models-dir runs one API server process (its loads "
                         "and unloads are decided in one place): drop --api-server-count")
    models = catalog(Path(gateway_cfg.models_dir))
    if not models:
        raise SystemExit(f"kestrel serve: {gateway_cfg.models_dir} holds no model (GGUF files, "
                         "folders with a config.json)")
    asked = _model_given(argv)
    if asked is not None and asked not in models:
        path = Path(asked).expanduser()
        models = {**models, (gguf_model_name(path) if path.suffix == ".gguf" else path.name):
                  str(path)}
    workers = WorkerProcesses(worker_cfg, models)
    if asked is not None:
        workers.start(next(m for m, p in models.items() if asked in (m, p)))
    log.info("serving %d models from %s: %s", len(models), gateway_cfg.models_dir,
             ", ".join(models))
    try:
        run(gateway_cfg, workers)
    finally:
        # The gateway's drain has ended their requests: a worker has only to exit now, and one
        # that is stuck is killed, all within the drain timeout plus this.
        workers.stop_all(WORKERS_EXIT_S)
    return 0


def _model_given(argv: Sequence[str] | None) -> str | None:
    """The MODEL or --model of the command line or environment (the worker's default model
    otherwise is not asked for)."""
    args, _ = build_parser().parse_known_args(argv)
    return args.model_arg or getattr(args, "worker.model") or os.environ.get(env_name("model"))


def script_main() -> int:
    """`kestrel-serve`, the older name of `kestrel serve`."""
    return main(prog="kestrel-serve")


if __name__ == "__main__":
    raise SystemExit(main())
