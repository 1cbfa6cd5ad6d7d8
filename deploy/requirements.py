"""Print the requirements an image installs, read from pyproject.toml alone (no sources needed).

    python requirements.py pyproject.toml [EXTRA ...] [--exclude NAME ...]  >  requirements.txt

The images install these in a layer of their own before they copy any source file, so a code edit
reuses the dependency layers. `--exclude torch` leaves torch to the worker image's own install
from PyTorch's index for the chosen build (CPU or CUDA); the default index would give the CUDA one.
Standard library only (tomllib: Python 3.11+, which the images use).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import tomllib

NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_name(spec: str) -> str:
    """The normalised distribution name of a requirement line ('Torch>=2' -> 'torch')."""
    match = NAME.match(spec)
    if match is None:
        raise ValueError(f"not a requirement: {spec!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path, extras: list[str], exclude: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    specs = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r}; pyproject.toml has {sorted(optional)}")
        specs += optional[extra]
    dropped = {requirement_name(e) for e in exclude}
    return [s for s in dict.fromkeys(specs) if requirement_name(s) not in dropped]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("extras", nargs="*")
    parser.add_argument("--exclude", action="append", default=[])
    args = parser.parse_args(argv)
    print("\n".join(requirements(args.pyproject, args.extras, args.exclude)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
