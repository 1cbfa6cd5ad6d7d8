"""`kestrel COMMAND ...`: one entry point for the parts, like `vllm serve` / `vllm bench`.

    kestrel serve [MODEL] [flags]   the gateway and one worker on this host (kestrel/serve.py)
    kestrel gateway [flags]         the HTTP gateway alone (kestrel-gateway)
    kestrel worker [flags]          one engine worker (kestrel-worker)
    kestrel loadgen run|sweep ...   the load generator (kestrel-loadgen); `kestrel bench` too

Each command's module is imported only when chosen: `kestrel serve` and `kestrel gateway` never
import torch in this process (the worker does, in its own).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "serve": ("kestrel.serve", "the gateway and one worker on this host"),
    "gateway": ("gateway.main", "the HTTP gateway alone"),
    "worker": ("engine_worker.main", "one engine worker, joining a gateway"),
    "loadgen": ("loadgen.cli", "the load generator (run, sweep)"),
    "bench": ("loadgen.cli", "the same as loadgen"),
}


def usage() -> str:
    lines = ["usage: kestrel {" + ",".join(COMMANDS) + "} ...", "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`kestrel COMMAND --help` lists a command's flags."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"{usage()}\n\nkestrel: error: unknown command {command!r}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    if command == "serve":
        return int(module.main(rest, prog="kestrel serve"))
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
