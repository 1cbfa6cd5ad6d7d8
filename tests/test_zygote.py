"""The tests' worker zygote (tests/zygote.py, tests/procs.py): a forked worker is the worker a
started one is (its log, its exit status, its signals), and a worker whose environment differs
in what torch reads as it loads is started as a process of its own."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.procs import Forked, GatewayProc, WorkerProc, Zygote

pytestmark = pytest.mark.skipif(Zygote.get("engine_worker.main") is None,
                                reason="no zygote here")


def test_a_forked_worker_exits_as_a_started_one_does(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    codes, logs = [], []
    for forked in (True, False):
        wk = WorkerProc(missing, "tcp://127.0.0.1:9", env=None if forked else {
            "KESTREL_CPU_ISA": "not-the-zygotes"})  # another import-time value: not forked
        wk.start()
        assert isinstance(wk.popen, Forked) == forked
        codes.append(wk.popen.wait(60))
        logs.append(wk.output())
        wk.stop()
    assert codes[0] == codes[1] != 0, (codes, logs)
    assert str(missing) in logs[0] and str(missing) in logs[1]


def test_a_forked_worker_drains_on_sigterm_and_exits_0(tiny_model_dir: Path) -> None:
    with GatewayProc() as gw, WorkerProc(tiny_model_dir, gw.engine_address) as wk:
        gw.wait_ready()
        assert isinstance(wk.popen, Forked)
        wk.signal(signal.SIGTERM)
        assert wk.popen.wait(30) == 0, wk.output()[-2000:]
        assert "draining" in wk.output()


def test_waiting_on_a_forked_worker_times_out_as_popen_does(tmp_path: Path) -> None:
    never = Forked(1, ["worker"], tmp_path / "no.rc")  # no status is ever written there
    with pytest.raises(subprocess.TimeoutExpired):
        never.wait(0.05)
    assert never.poll() is None


def test_a_forked_gateway_serves_and_exits_0_on_sigterm() -> None:
    with GatewayProc() as gw:
        assert isinstance(gw.popen, Forked)
        gw.wait_live()
        # a new interpreter's dispositions: SIGPIPE ignored (a client gone mid-write is an
        # error to handle, not the end of the process; it was, when the fork reset it)
        status = Path(f"/proc/{gw.popen.pid}/status").read_text()
        ignored = int(next(line.split()[1] for line in status.splitlines()
                           if line.startswith("SigIgn:")), 16)
        assert ignored & (1 << (signal.SIGPIPE - 1))
        gw.signal(signal.SIGTERM)
        assert gw.popen.wait(30) == 0, gw.output()[-2000:]
