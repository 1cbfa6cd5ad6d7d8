"""`python -m kestrel.with_parent MODULE [ARGS]`: run MODULE as `python -m MODULE [ARGS]` would,
in a process that dies with the one that started it.

The launcher (`kestrel serve`) starts its workers through this, so a launcher killed with
SIGKILL, or one whose shutdown never reached its `finally`, leaves no worker behind holding a
model's memory as an orphan: Linux sends the child SIGKILL when its parent dies
(PR_SET_PDEATHSIG). The parent's pid is checked after the call, since the parent may have died
between the fork and it. Set before MODULE is imported (before torch), so a worker still
loading its model dies too. Elsewhere than Linux it only runs MODULE.

PR_SET_PDEATHSIG fires when the thread that started the child ends, not only its process: the
launcher starts workers from its main thread (the gateway's event loop), which lives as long as
the launcher does.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> bool:
    """Ask the kernel for SIGKILL when `parent` (our parent now) dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # it died before the call: nobody would signal us
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m kestrel.with_parent MODULE [ARGS]")
    parent = int(os.environ.get("KESTREL_LAUNCHER_PID", os.getppid()))
    die_with_parent(parent)
    module = sys.argv[1]
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def command(module: str) -> list[str]:
    """The argv that runs `module` as a child that dies with this process."""
    return [sys.executable, "-m", "kestrel.with_parent", module]


def environ() -> dict[str, str]:
    """What the child is told of its parent (this process)."""
    return {"KESTREL_LAUNCHER_PID": str(os.getpid())}


if __name__ == "__main__":
    main()
