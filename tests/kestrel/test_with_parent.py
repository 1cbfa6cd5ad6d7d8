"""kestrel/with_parent.py: a child started through it dies with its parent, even one killed
with SIGKILL (which no `finally` survives), and runs its module with its own arguments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARENT = """
import subprocess, sys, time
from kestrel import with_parent
child = subprocess.Popen(with_parent.command("sleeper") + ["--flag"],
                         env={**__import__("os").environ, **with_parent.environ()})
print(child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_child_dies_when_its_parent_is_killed_and_gets_its_own_arguments(
        tmp_path: Path) -> None:
    argv_file = tmp_path / "argv"
    (tmp_path / "sleeper.py").write_text(
        "import sys, time\n"
        f"open({str(argv_file)!r}, 'w').write(' '.join(sys.argv[1:]))\n"
        "time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=env, stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        end = time.monotonic() + 30
        while not argv_file.exists() or not argv_file.read_text():
            assert time.monotonic() < end, "the child never ran its module"
            time.sleep(0.05)
        assert argv_file.read_text() == "--flag"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        end = time.monotonic() + 5
        while alive(child):
            assert time.monotonic() < end, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
        if "child" in locals() and alive(child):
            os.kill(child, signal.SIGKILL)
