"""Run a command as on a slower host: inside a cgroup whose CPU quota is this host's cores
divided by --slowdown, so everything it starts (the test processes, their gateways and
workers) shares that much CPU time. Its wall time is a stand-in for a host that many times
slower, all of whose cores are as slow; memory bandwidth and caches stay this host's.

    python benchmarks/slow_host.py --slowdown 1.9 -- make test

Prints the quota, the command's wall time and its exit status, and exits with that status.
Needs root and a cgroup file system this process may write (cgroup v2's cpu.max or v1's
cpu.cfs_quota_us); says so and exits 2 where it has neither. The quota's period is 10 ms, so
a throttled process waits at most that long: a host whose cores are slow, not one that stalls.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

PERIOD_US = 10_000


def make_group(name: str, cores: float) -> Path:
    """The cgroup's folder, with the CPU quota set."""
    quota = max(1000, int(cores * PERIOD_US))
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists():
        group = v2 / name
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        return group
    group = Path("/sys/fs/cgroup/cpu") / name
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (group / "cpu.cfs_quota_us").write_text(str(quota))
    return group


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slowdown", type=float, required=True,
                    help="how many times slower than this host (its cores / this = the quota)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command or a.slowdown < 1:
        ap.error("give --slowdown >= 1 and a command after --")
    cores = len(os.sched_getaffinity(0)) / a.slowdown
    try:
        group = make_group(f"kestrel-slow-{os.getpid()}", cores)
    except OSError as e:
        print(f"slow_host: cannot make a cgroup with a CPU quota here ({e})", file=sys.stderr)
        return 2
    print(f"slow_host: {cores:.2f} cores' worth of CPU time ({a.slowdown}x slower than "
          f"{len(os.sched_getaffinity(0))} cores), period {PERIOD_US // 1000} ms, cgroup {group}",
          flush=True)
    start = time.monotonic()
    child = subprocess.Popen(command, preexec_fn=lambda: (group / "cgroup.procs").write_text(
        str(os.getpid())))
    rc = child.wait()
    wall = time.monotonic() - start
    print(f"slow_host: {' '.join(command)}: exit {rc} after {int(wall // 60)} min "
          f"{wall % 60:.1f} s", flush=True)
    for _ in range(50):  # the command's stray children may take a moment to go
        try:
            group.rmdir()
            break
        except OSError:
            time.sleep(0.1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
