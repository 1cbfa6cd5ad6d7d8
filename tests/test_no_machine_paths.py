"""Issue 54: no script names one machine's checkout or user folder, so each runs on any host.

Scripts find the repository from their own place (`cd "$(dirname "$0")/.."`, `Path(__file__)`)
and a user's files through `~` or an environment variable, never a path like /home/<user> or
the checkout's own folder. tests/ is left out: its strings stand for paths in the outputs that
gateway code must redact (a Rust panic's /root/.cargo/...), not for paths any test opens.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# An absolute home folder or a checkout folder of these machines: /home/x, /root/, /work/
MACHINE_PATH = re.compile(r"(?<![\w.~$}-])/(?:home/[\w.-]+|root/|work/)")


def scripts() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    return [ROOT / name for name in listed
            if not name.startswith("tests/") and (ROOT / name).is_file()
            and (name.endswith((".py", ".sh")) or Path(name).name == "Makefile")]


def test_no_script_names_a_machines_checkout_or_home_folder() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in scripts()
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert not found, "\n".join(found)


def test_the_check_sees_a_checkout_path() -> None:
    assert MACHINE_PATH.search("python benchmarks/start_time.py /work/main f")
    assert MACHINE_PATH.search("cd /home/alice/kestrel")
    assert not MACHINE_PATH.search('cd "$(dirname "$0")/.." && ~/.cache/kestrel')
