"""`kestrel-serve`: gateway and one worker on this host, for local use (`make serve`).

Flags are the gateway's; the worker reads its own KESTREL_* variables from the environment and
is pointed at this gateway. The worker is a child process: it is stopped when the gateway exits.
"""

from __future__ import annotations

import os
import subprocess
import sys

from gateway.main import parse, run


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    env = {**os.environ, "KESTREL_GATEWAY_ADDRESS": cfg.engine_address}
    worker = subprocess.Popen([sys.executable, "-m", "engine_worker.main"], env=env)
    try:
        run(cfg)
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
