"""The compose files of deploy/, loaded and merged the way `docker compose -f A -f B` merges them.

    services(gpu=True) -> {"gateway": {...}, "worker": {...}, ...}

Merge rule (the Compose specification's, for the keys our files use): mappings merge key by
key, the later file winning; anything else is replaced. `environment` is always a mapping here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
BASE = DEPLOY / "docker-compose.yml"
GPU = DEPLOY / "docker-compose.gpu.yml"


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    return over


def project(gpu: bool = False) -> dict[str, Any]:
    doc = load(BASE)
    return merge(doc, load(GPU)) if gpu else doc


def seconds(duration: str) -> float:
    """A compose duration ('45s', '1m30s', '500ms') in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    total, number = 0.0, ""
    rest = duration.strip()
    while rest:
        if rest[0].isdigit() or rest[0] == ".":
            number += rest[0]
            rest = rest[1:]
            continue
        unit = "ms" if rest.startswith("ms") else "us" if rest.startswith("us") else rest[0]
        total += float(number) * units[unit]
        number, rest = "", rest[len(unit):]
    if number:
        raise ValueError(f"duration without a unit: {duration!r}")
    return total
