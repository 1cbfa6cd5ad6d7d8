"""Issue 23: at SIGTERM, a request whose body is still arriving is answered 503 at once (it was
not admitted), so the drain ends when the admitted work does. Before, such requests held the
drain until uvicorn's last resort cancelled them mid-request: 500s, and an exit at drain + 2.5 s.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

from tests.procs import GatewayProc, WorkerProc, read_response

DRAIN_S = 4.0


def test_bodies_still_arriving_at_sigterm_get_503_and_the_drain_does_not_wait_for_them(
        tiny_model_dir: Path) -> None:
    with GatewayProc("--drain-timeout-s", str(DRAIN_S), "--body-timeout-s", "60") as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1"):
        gw.wait_ready()
        slow = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(3)]
        try:
            for s in slow:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          b"application/json\r\nContent-Length: 40\r\n\r\n{")
                s.settimeout(DRAIN_S + 5)
            time.sleep(0.5)
            start = time.monotonic()
            gw.signal(signal.SIGTERM)
            answers = [read_response(s) for s in slow]
            answered = time.monotonic() - start
        finally:
            for s in slow:
                s.close()
        for got in answers:
            assert got.startswith(b"HTTP/1.1 503"), got[:300]
            assert b"shutting_down" in got
        assert answered < 2, answered
        assert gw.popen is not None and gw.popen.wait(timeout=DRAIN_S + 5) == 0
        assert time.monotonic() - start < DRAIN_S, "the drain waited for the bodies"
    assert "Traceback" not in gw.output(), gw.output()[-3000:]
