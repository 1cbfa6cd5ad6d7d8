"""Issue 42, end to end: a Hello over the link's 16 MiB frame limit is named on both sides.

libzmq closes the connection of a peer whose frame is over MAXMSGSIZE before reading it: a
worker whose tokenizer and template came to more than that sent its Hello, heard nothing, and
sent it again forever, while the gateway logged nothing. The worker now measures its Hello
before sending it and exits 2 in one line naming the limit; the gateway says, once a minute at
most, that a connection that was no worker's closed and why that may be.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import zmq

from protocol import codec
from tests.procs import GatewayProc, WorkerProc


def test_a_worker_whose_hello_is_over_the_limit_exits_in_one_line(tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    model = tmp_path / "tiny-huge-template"
    shutil.copytree(tiny_model_dir, model)
    template = "{{ messages[0].content }}" + " " * (codec.MAX_FRAME_BYTES + 1)
    (model / "chat_template.jinja").write_text(template, encoding="utf-8")
    with GatewayProc() as gw, WorkerProc(model, gw.engine_address, "--threads", "1") as wk:
        assert wk.popen is not None
        assert wk.popen.wait(timeout=120) == 2
        gw.wait_live()  # a refusal may come before the gateway listens
        assert httpx.get(gw.base_url + "/health/ready", timeout=5).status_code == 503
    msg = wk.only_error()
    assert msg.startswith("model refused: the Hello is") and "frame limit of 16 MiB" in msg, msg
    assert "chat template 16.0 MiB" in msg, msg


def test_the_gateway_says_a_connection_closed_that_may_have_been_over_the_limit() -> None:
    with GatewayProc() as gw:
        gw.wait_live()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(gw.engine_address)
        try:
            sock.send_multipart([b"\x01", b"\x00" * (codec.MAX_FRAME_BYTES + 1024)])
            assert monitor.poll(30_000), "the gateway kept a connection sending an oversized frame"
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()
        deadline = time.monotonic() + 10
        while "over the link's 16 MiB limit" not in gw.output():
            assert time.monotonic() < deadline, gw.output()[-2000:]
            time.sleep(0.05)
