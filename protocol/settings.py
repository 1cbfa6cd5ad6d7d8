"""Settings: one frozen dataclass per process, filled from flags and environment variables.

Every field of a settings dataclass becomes a flag `--some-name` and an environment variable
`KESTREL_SOME_NAME`; a flag wins over the variable, the variable over the field's default. The
dataclass validates itself in `__post_init__` (raising ValueError); `parse_settings` turns that
into a clear message and exit status 2, once, at start. Nothing changes a settings object after.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

ENV_PREFIX = "KESTREL_"

T = TypeVar("T")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _scalar_type(tp: Any) -> tuple[type, bool]:
    """(base type, optional) for hints like int, float | None, str."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0], True
    return tp, False


def _convert(text: str, tp: Any, optional: bool) -> Any:
    if optional and text.strip().lower() in ("", "none"):
        return None
    if tp is bool:
        return _parse_bool(text)
    if tp is tuple or typing.get_origin(tp) is tuple:
        return tuple(p.strip() for p in text.split(",") if p.strip())
    return tp(text)


def parse_settings(
    cls: type[T],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> T:
    """Build `cls` from flags and the environment. `extra_env` maps field -> a non-prefixed
    variable that also sets it (PORT for the HTTP port), below the prefixed one."""
    environ = os.environ if environ is None else environ
    extra_env = extra_env or {}
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for f in dataclasses.fields(cls):
        tp, optional = _scalar_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        var = env_name(f.name)
        help_text = f"{f.metadata.get('help', '')} (env {var}"
        help_text += f" or {extra_env[f.name]}" if f.name in extra_env else ""
        help_text += f"; default {default!r})"
        flag = "--" + f.name.replace("_", "-")
        if tp is bool:
            parser.add_argument(flag, dest=f.name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(),
                                help=help_text)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp, optional = _scalar_type(hints[f.name])
        raw = getattr(args, f.name)
        source = "--" + f.name.replace("_", "-")
        if raw is None:
            for var in (env_name(f.name), extra_env.get(f.name)):
                if var and var in environ:
                    raw, source = environ[var], var
                    break
        if raw is None:
            continue
        try:
            values[f.name] = raw if isinstance(raw, bool) else _convert(raw, tp, optional)
        except ValueError as exc:
            parser.exit(2, f"{parser.prog}: error: {source}: {exc}\n")
    try:
        return cls(**values)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: invalid settings: {exc}\n")
        raise  # unreachable; keeps type checkers calm


def setting(default: Any, help: str, **kw: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help}, **kw)

