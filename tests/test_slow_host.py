"""benchmarks/slow_host.py: a command run under it gets the CPU share it names, and its exit
status comes back. Skipped where no cgroup with a CPU quota can be made (not root, or no
writable cgroup file system)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPIN = ("import time\nt = time.process_time()\n"
        "while time.process_time() - t < 0.4: pass\n")  # 0.4 s of one core's time


def slow(slowdown: float, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "benchmarks/slow_host.py", "--slowdown",
                           str(slowdown), "--", sys.executable, "-c", code],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_command_gets_the_named_share_of_cpu_time_and_its_exit_status_back() -> None:
    probe = slow(1, "pass")
    if probe.returncode == 2 and "cannot make a cgroup" in probe.stderr:
        pytest.skip(probe.stderr.strip())
    assert probe.returncode == 0, probe.stderr
    cores = float(probe.stdout.split(" cores'")[0].rsplit(" ", 1)[-1])
    # a tenth of a core for the spin: 0.4 s of CPU time needs 4 s of wall time at least
    got = slow(10 * cores, SPIN + "import sys; sys.exit(3)")
    assert got.returncode == 3, got.stderr
    line = got.stdout.strip().splitlines()[-1]
    minutes, seconds = line.split("after ")[1].split(" min ")
    assert 60 * int(minutes) + float(seconds.rstrip(" s")) >= 4, got.stdout
    group = Path(got.stdout.split("cgroup ", 1)[1].split()[0])
    assert group.name.startswith("kestrel-slow-") and not group.exists(), "the cgroup was left"
