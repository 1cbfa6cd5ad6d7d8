"""deploy/healthcheck.py on its own: the link port read from the worker's address, ESTABLISHED
connections found in /proc/net/tcp{,6} (only those), and a real connection seen as linked.
The end-to-end use (compose gating, a real worker) is in test_compose_processes.py."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "healthcheck.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kestrel_healthcheck", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"


def test_link_port_comes_from_the_zeromq_address() -> None:
    hc = load()
    assert hc.link_port("tcp://gateway:5557") == 5557
    assert hc.link_port("tcp://10.0.0.1:6000") == 6000
    for bad in ("ipc:///tmp/x", "tcp://gateway", "gateway:5557"):
        with pytest.raises(ValueError):
            hc.link_port(bad)


def test_only_established_connections_count(tmp_path: Path) -> None:
    hc = load()
    (tmp_path / "tcp").write_text(
        HEADER
        + "   0: 0100007F:A1B2 0100007F:15B5 01 00000000:00000000 00:00000000 00000000  1000\n"
        + "   1: 0100007F:A1B3 0100007F:1F90 06 00000000:00000000 00:00000000 00000000  1000\n"
        + "   2: 00000000:15B5 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000\n")
    (tmp_path / "tcp6").write_text(
        HEADER + "   0: 00000000000000000000000001000000:C000 "
                 "00000000000000000000000001000000:1388 01 00000000:00000000 00:00000000 "
                 "00000000  1000\n")
    # 0x15B5 = 5557 established; 0x1F90 = 8080 in TIME_WAIT; a listener; 0x1388 = 5000 over v6.
    assert hc.established_remote_ports(tmp_path) == {5557, 5000}


def test_a_live_connection_is_seen_and_a_closed_one_is_not() -> None:
    hc = load()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        env = {"KESTREL_GATEWAY_ADDRESS": f"tcp://127.0.0.1:{port}"}
        assert not hc.worker_linked(env)
        with socket.create_connection(("127.0.0.1", port)):
            conn, _ = server.accept()
            with conn:
                assert hc.worker_linked(env)
    assert hc.main(["nonsense"]) == 2
