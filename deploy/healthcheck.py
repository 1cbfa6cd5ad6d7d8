"""Container health checks for the two images (Docker HEALTHCHECK, compose and Kubernetes probes).

    python deploy/healthcheck.py gateway   # GET /health/live on 127.0.0.1:$PORT (default 8000)
    python deploy/healthcheck.py worker    # a TCP connection to the gateway's link port is up

Exit 0 healthy, 1 not. Standard library only, read from the same environment as the process.

The gateway's check is liveness, not readiness, on purpose: the gateway is ready only once a
worker has joined, and the worker waits for a healthy gateway before it starts (compose
depends_on), so a readiness check here would keep both down forever.

The worker has no HTTP port. Its link thread starts only after the model is loaded and ZeroMQ
keeps the TCP connection to the gateway open (reconnecting when it drops), so "this container
holds an ESTABLISHED connection to the link port named in KESTREL_GATEWAY_ADDRESS" means loaded
and linked. It reads /proc/net/tcp{,6}, which in a container lists the container's own sockets
(on a bare host it lists the host's: any process linked to that port counts).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_GATEWAY_ADDRESS = "tcp://127.0.0.1:5557"  # protocol.transport.DEFAULT_ENGINE_ADDRESS
TCP_ESTABLISHED = "01"


def gateway_alive(environ: dict[str, str] | os._Environ[str], timeout: float = 3.0) -> bool:
    port = environ.get("KESTREL_PORT") or environ.get("PORT") or "8000"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/live",
                                    timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def link_port(address: str) -> int:
    """The port of a ZeroMQ tcp:// address ('tcp://gateway:5557' -> 5557)."""
    if not address.startswith("tcp://") or ":" not in address[len("tcp://"):]:
        raise ValueError(f"not a tcp:// ZeroMQ address with a port: {address!r}")
    return int(address.rsplit(":", 1)[1])


def established_remote_ports(proc_net: Path = Path("/proc/net")) -> set[int]:
    """Remote ports of this network namespace's ESTABLISHED TCP connections."""
    ports: set[int] = set()
    for name in ("tcp", "tcp6"):
        path = proc_net / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()  # sl local_address rem_address st ...
            if len(fields) > 3 and fields[3] == TCP_ESTABLISHED:
                ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def worker_linked(environ: dict[str, str] | os._Environ[str]) -> bool:
    address = environ.get("KESTREL_GATEWAY_ADDRESS", DEFAULT_GATEWAY_ADDRESS)
    return link_port(address) in established_remote_ports()


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("gateway", "worker"):
        print("usage: healthcheck.py gateway|worker", file=sys.stderr)
        return 2
    ok = gateway_alive(os.environ) if argv[0] == "gateway" else worker_linked(os.environ)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
