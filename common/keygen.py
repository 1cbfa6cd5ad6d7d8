"""`kestrel-keygen NAME --dir DIR`: a CURVE key pair for the engine link, in pyzmq's format.

Writes DIR/NAME.key (public: give it to the other side) and DIR/NAME.key_secret (both keys: keep
it, mode 0600). The gateway loads its own .key_secret and a folder of the workers' .key files;
a worker loads its own .key_secret and the gateway's .key.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import zmq.auth

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def make_key_pair(name: str, folder: Path, force: bool = False) -> tuple[Path, Path]:
    if not _NAME.match(name):
        raise ValueError(f"name must be 1-64 of [A-Za-z0-9._-], starting alphanumeric: {name!r}")
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    if not force and (public.exists() or secret.exists()):
        raise FileExistsError(f"{public} or {secret} exists (pass --force to replace)")
    # The secret must never exist with wider permissions, not even for a moment: create the
    # files under a 0077 umask, then make sure of the mode (an existing file keeps its own).
    old = os.umask(0o077)
    try:
        for path in (public, secret):
            path.unlink(missing_ok=True)
        zmq.auth.create_certificates(str(folder), name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kestrel-keygen", description=__doc__.splitlines()[0])
    parser.add_argument("name", help="key pair name, e.g. gateway or worker-1")
    parser.add_argument("--dir", default=".", help="folder to write NAME.key and NAME.key_secret")
    parser.add_argument("--force", action="store_true", help="replace an existing pair")
    args = parser.parse_args(argv)
    try:
        public, secret = make_key_pair(args.name, Path(args.dir), args.force)
    except (ValueError, FileExistsError, OSError) as exc:
        print(f"kestrel-keygen: error: {exc}", file=sys.stderr)
        return 2
    print(f"public key: {public}\nsecret key: {secret} (mode 0600: keep it on this host)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
