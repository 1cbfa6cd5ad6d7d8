"""Check a deployment's command line and environment against the real settings of the process.

    check_command(["python", "-m", "gateway.main", "--drain-timeout-s", "30"], env)
        -> the GatewayConfig that process would run with (or AssertionError / SystemExit)

Every flag must be one `protocol.settings.parse_settings` builds for that process's config class,
every KESTREL_* variable one of its fields, and the values must pass the config's validation.

PENDING_LINK_FLAGS are issue 12's link-key settings, wired into deploy/ before that issue's code
is merged. Until a config class has the field, its flag (with its value) and variable are
tolerated and dropped here; once the field exists they are checked like every other. Remove the
list when issue 12 is merged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine_worker.config import WorkerConfig
from gateway.config import GatewayConfig
from protocol.settings import ENV_PREFIX, env_name, parse_settings

# module run with `python -m` -> (config class, non-prefixed variables it also reads)
PROCESSES: dict[str, tuple[type, dict[str, str]]] = {
    "gateway.main": (GatewayConfig, {"port": "PORT"}),
    "engine_worker.main": (WorkerConfig, {}),
}

# TODO(issue 12): the link-key settings, not in the code yet. Tolerated only while absent.
PENDING_LINK_FLAGS: dict[str, set[str]] = {
    "gateway.main": {"link_secret_key", "link_authorized_keys"},
    "engine_worker.main": {"link_secret_key", "link_gateway_key"},
}


def module_of(argv: list[str]) -> str:
    assert argv[:2] == ["python", "-m"] and argv[2] in PROCESSES, argv
    return argv[2]


def field_names(module: str) -> set[str]:
    return {f.name for f in dataclasses.fields(PROCESSES[module][0])}


def pending(module: str) -> set[str]:
    """Issue 12's settings this process does not have yet."""
    return PENDING_LINK_FLAGS[module] - field_names(module)


def strip_pending(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """argv and env without the not-yet-existing link-key flags (each takes one value)."""
    module = module_of(argv)
    flags = {"--" + n.replace("_", "-") for n in pending(module)}
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    names = {env_name(n) for n in pending(module)}
    return out, {k: v for k, v in env.items() if k not in names}


def check_command(argv: list[str], env: dict[str, str]) -> Any:
    module = module_of(argv)
    cls, extra_env = PROCESSES[module]
    argv, env = strip_pending(argv, env)
    known = {env_name(n) for n in field_names(module)} | set(extra_env.values())
    for name in env:
        if name.startswith(ENV_PREFIX) or name in ("PORT",):
            assert name in known, f"{module} does not read {name}"
    return parse_settings(cls, argv[3:], env, extra_env=extra_env)
