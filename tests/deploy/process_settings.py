"""Check a deployment's command line and environment against the real settings of the process.

    check_command(["python", "-m", "gateway.main", "--drain-timeout-s", "30"], env)
        -> the GatewayConfig that process would run with (or AssertionError / SystemExit)

Every flag must be one `common.settings.parse_settings` builds for that process's config class,
every KESTREL_* variable one of its fields, and the values must pass the config's validation.

Path-valued link-key settings (issue 12) are checked to exist by the configs; the deploy files
name paths inside a container (secrets under /run/secrets, a mounted folder), so `check_command`
checks each is absolute and then points it at a real local file or folder of the same kind.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

from common.settings import ENV_PREFIX, env_name, parse_settings
from engine_worker.config import WorkerConfig
from engine_worker.kernel_build import PREBUILT_ENV
from gateway.config import GatewayConfig

# module run with `python -m` -> (config class, variables it also reads outside its config)
PROCESSES: dict[str, tuple[type, dict[str, str]]] = {
    "gateway.main": (GatewayConfig, {"port": "PORT"}),
    "engine_worker.main": (WorkerConfig, {"prebuilt kernels": PREBUILT_ENV}),
}

# field -> "file" or "dir": link-key settings whose value must exist where the process runs
CONTAINER_PATHS: dict[str, dict[str, str]] = {
    "gateway.main": {"link_secret_key": "file", "link_authorized_keys": "dir"},
    "engine_worker.main": {"link_secret_key": "file", "link_gateway_key": "file"},
}


def module_of(argv: list[str]) -> str:
    assert argv[:2] == ["python", "-m"] and argv[2] in PROCESSES, argv
    return argv[2]


def field_names(module: str) -> set[str]:
    return {f.name for f in dataclasses.fields(PROCESSES[module][0])}


def _local(kind: str) -> str:
    if kind == "dir":
        return tempfile.mkdtemp(prefix="kestrel-deploy-")
    fd, path = tempfile.mkstemp(prefix="kestrel-deploy-")
    os.close(fd)
    return path


def localize_paths(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """argv and env with each container path of CONTAINER_PATHS (absolute, or it fails) replaced
    by a local file or folder of the same kind."""
    paths = CONTAINER_PATHS[module_of(argv)]
    flags = {"--" + n.replace("_", "-"): k for n, k in paths.items()}
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in flags:
            assert out[i + 1].startswith("/"), f"{arg} {out[i + 1]!r} is not a container path"
            out[i + 1] = _local(flags[arg])
    env = dict(env)
    for name, kind in paths.items():
        var = env_name(name)
        if env.get(var):
            assert env[var].startswith("/"), f"{var}={env[var]!r} is not a container path"
            env[var] = _local(kind)
    return out, env


def check_command(argv: list[str], env: dict[str, str]) -> Any:
    module = module_of(argv)
    cls, extra_env = PROCESSES[module]
    argv, env = localize_paths(argv, env)
    known = {env_name(n) for n in field_names(module)} | set(extra_env.values())
    for name in env:
        if name.startswith(ENV_PREFIX) or name in ("PORT",):
            assert name in known, f"{module} does not read {name}"
    return parse_settings(cls, argv[3:], env, extra_env=extra_env)
