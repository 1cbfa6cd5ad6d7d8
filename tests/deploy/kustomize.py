"""Render a kustomization the way `kubectl kustomize` does, for the subset deploy/k8s uses.

    render(Path("deploy/k8s/overlays/gpu")) -> [{"apiVersion": ..., "kind": ..., ...}, ...]

Supported: `resources` (files and folders holding a kustomization, recursively),
`secretGenerator` with `files` (KEY=PATH or PATH), and `generatorOptions.disableNameSuffixHash:
true`. Any other field raises, so the result is exact for what it accepts; where kubectl is
installed, tests/deploy compares it with kubectl's own output.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

KNOWN = {"apiVersion", "kind", "resources", "secretGenerator", "generatorOptions"}


def _secret(spec: dict[str, Any], root: Path) -> dict[str, Any]:
    extra = set(spec) - {"name", "files"}
    if extra:
        raise ValueError(f"unsupported secretGenerator fields: {sorted(extra)}")
    data: dict[str, str] = {}
    for item in spec["files"]:
        key, _, path = item.partition("=") if "=" in item else (Path(item).name, "", item)
        data[key] = base64.b64encode((root / path).read_bytes()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": spec["name"]}, "data": data}


def render(root: Path) -> list[dict[str, Any]]:
    kust = yaml.safe_load((root / "kustomization.yaml").read_text(encoding="utf-8"))
    unknown = set(kust) - KNOWN
    if unknown:
        raise ValueError(f"{root}: fields this renderer does not handle: {sorted(unknown)}")
    if kust.get("secretGenerator") and not (kust.get("generatorOptions") or {}).get(
            "disableNameSuffixHash"):
        raise ValueError(f"{root}: name-suffix hashes are not rendered; disable them")
    objects: list[dict[str, Any]] = []
    for res in kust.get("resources", []):
        path = (root / res).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    objects += [_secret(s, root) for s in kust.get("secretGenerator", [])]
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    if len(keys) != len(set(keys)):
        raise ValueError(f"{root}: duplicate objects {sorted(keys)}")
    return objects
