"""Settings: one frozen dataclass per process, filled from flags and environment variables.

Every field of a settings dataclass becomes a flag `--some-name` and an environment variable
`KESTREL_SOME_NAME`; a flag wins over the variable, the variable over the field's default. The
dataclass validates itself in `__post_init__` (raising ValueError); `parse_settings` turns that
into a clear message and exit status 2, once, at start. Nothing changes a settings object after.

    dataclass fields ──add_settings──▶ argparse (group) ──parse──▶ Namespace
      ──settings_from──▶ (flag, else env, else default) ──▶ cls(**values) (validated)

A field's metadata may add other spellings of its flag (`flags=("--api-key",)`, for names users
know from vLLM) and let it be given several times (`repeat="append"`: one value per flag;
`repeat="extend"`: one or more values per flag); the values are joined with commas into the
field's text. Prefix abbreviation is off everywhere (`allow_abbrev=False`): `--api-key` must never
be read as `--api-key-file`, nor a typo as some longer flag. `kestrel serve` builds one parser from
two processes' dataclasses with the same functions (`dest_prefix` keeps their fields apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

ENV_PREFIX = "KESTREL_"

T = TypeVar("T")
ArgGroup = argparse.ArgumentParser | argparse._ArgumentGroup


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def new_parser(prog: str | None = None, description: str | None = None,
               **kw: Any) -> argparse.ArgumentParser:
    """An ArgumentParser that never expands a prefix of a flag into a longer flag."""
    return argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False, **kw)


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


def _to_text(value: Any) -> str:
    """The inverse of _convert, for handing a resolved setting to a child process."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def add_settings(group: ArgGroup, cls: type, *, dest_prefix: str = "", flag_prefix: str = "",
                 skip: Sequence[str] = (), extra_env: Mapping[str, str] | None = None) -> None:
    """Add one flag per field of `cls` (but `skip`) to a parser or argument group.

    `dest_prefix` namespaces the argparse destinations (two dataclasses in one parser);
    `flag_prefix` renames the main flag (`--worker-` + name) where two processes share a name but
    not a meaning. Extra spellings from a field's metadata that the parser already knows are left
    out, so a later field never steals an earlier one's flag.
    """
    extra_env = extra_env or {}
    hints = typing.get_type_hints(cls)
    known = _known_flags(group)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp, _ = _scalar_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        var = env_name(f.name)
        help_text = f"{f.metadata.get('help', '')} (env {var}"
        help_text += f" or {extra_env[f.name]}" if f.name in extra_env else ""
        help_text += f"; default {default!r})"
        main_flag = "--" + flag_prefix + f.name.replace("_", "-")
        flags = [main_flag, *(s for s in f.metadata.get("flags", ()) if s not in known)]
        known.update(flags)
        dest = dest_prefix + f.name
        repeat = f.metadata.get("repeat")
        if tp is bool:
            group.add_argument(*flags, dest=dest, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
        elif repeat in ("append", "extend"):
            nargs = "+" if repeat == "extend" else None
            group.add_argument(*flags, dest=dest, default=None, action=repeat, nargs=nargs,
                               metavar=f.name.upper(), help=help_text + "; may be repeated")
        else:
            group.add_argument(*flags, dest=dest, default=None, metavar=f.name.upper(),
                               help=help_text)


def _known_flags(group: ArgGroup) -> set[str]:
    # An argument group shares its parser's table of option strings.
    return set(group._option_string_actions)


def settings_from(cls: type[T], args: argparse.Namespace, environ: Mapping[str, str],
                  error: Callable[[str], NoReturn], *, dest_prefix: str = "",
                  flag_prefix: str = "", extra_env: Mapping[str, str] | None = None,
                  fixed: Mapping[str, Any] | None = None) -> T:
    """Build `cls` from parsed flags (flag, else environment, else default). `fixed` values are
    set by the caller (not flags); `error` reports a bad value and must not return."""
    extra_env = extra_env or {}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = dict(fixed or {})
    for f in dataclasses.fields(cls):
        if f.name in values:
            continue
        tp, optional = _scalar_type(hints[f.name])
        raw = getattr(args, dest_prefix + f.name, None)
        source = "--" + flag_prefix + f.name.replace("_", "-")
        if isinstance(raw, list):  # a repeatable flag: its values joined, as the field's text
            raw = ",".join(raw)
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
            error(f"{source}: {exc}")
    try:
        return cls(**values)
    except ValueError as exc:
        error(f"invalid settings: {exc}")


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
    parser = new_parser(prog, description)
    add_settings(parser, cls, extra_env=extra_env)
    args = parser.parse_args(argv)
    return settings_from(cls, args, environ, lambda msg: parser.exit(
        2, f"{parser.prog}: error: {msg}\n"), extra_env=extra_env)


def settings_environ(obj: Any) -> dict[str, str]:
    """KESTREL_* variables that rebuild `obj` exactly in another process (parse_settings reads
    them when no flag is given). Used to hand a validated config to a child process."""
    return {env_name(f.name): _to_text(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A settings field. `flags`: other spellings of its flag; `repeat`: "append" or "extend"."""
    meta: dict[str, Any] = {"help": help}
    for key in ("flags", "repeat"):
        if key in kw:
            meta[key] = kw.pop(key)
    return dataclasses.field(default=default, metadata=meta, **kw)
