"""CURVE on the engine link, end to end: real gateway and worker processes with key files.

An authorized worker serves; a worker with a wrong key or none never appears in /health and
never receives a request, however it tries (the fake-worker attack: a Hello under the real
model's name, then text injected into whatever it is sent).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.keygen import make_key_pair
from protocol.transport import load_public_key, load_secret_key
from tests.e2e.link_peers import FakeWorker, tiny_hello
from tests.procs import GatewayProc, WorkerProc


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("link-keys")
    make_key_pair("gateway", root / "gateway")
    make_key_pair("worker-ok", root / "workers")
    make_key_pair("intruder", root / "intruders")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "worker-ok.key").write_bytes((root / "workers" / "worker-ok.key").read_bytes())
    return root


@pytest.fixture(scope="module")
def keyed(keys: Path, tiny_model_dir: Path) -> Iterator[tuple[GatewayProc, WorkerProc]]:
    with GatewayProc("--link-secret-key", str(keys / "gateway" / "gateway.key_secret"),
                     "--link-authorized-keys", str(keys / "allowed")) as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address,
                       "--link-secret-key", str(keys / "workers" / "worker-ok.key_secret"),
                       "--link-gateway-key", str(keys / "gateway" / "gateway.key")) as wk:
        gw.wait_ready()
        yield gw, wk


def complete(gw: GatewayProc, prompt: str = "Hello there") -> httpx.Response:
    return httpx.post(gw.base_url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 5, "temperature": 0}, timeout=30)


def worker_count(gw: GatewayProc) -> int:
    return len(httpx.get(gw.base_url + "/health").json()["workers"])


def test_an_authorized_worker_serves(keyed: tuple[GatewayProc, WorkerProc]) -> None:
    gw, wk = keyed
    assert complete(gw).status_code == 200
    assert worker_count(gw) == 1
    assert any(e.get("event") == "request_start" for e in wk.log_lines())


@pytest.mark.parametrize("who", ["wrong key", "no key"])
def test_a_fake_worker_without_an_authorized_key_never_joins_nor_gets_a_request(
        keyed: tuple[GatewayProc, WorkerProc], keys: Path, tiny_model_dir: Path,
        who: str) -> None:
    gw, _ = keyed
    server_key = load_public_key(keys / "gateway" / "gateway.key")
    intruder = load_secret_key(keys / "intruders" / "intruder.key_secret")
    fake = (FakeWorker(gw.engine_address, intruder, server_key) if who == "wrong key"
            else FakeWorker(gw.engine_address))
    try:
        # The attack of the issue: a Hello under the real model's name, more capacity than the
        # real worker, then text injected into every request it receives.
        assert fake.hello(tiny_hello(tiny_model_dir, max_num_seqs=64), timeout_s=3) is None
        assert worker_count(gw) == 1
        for i in range(12):
            r = complete(gw, f"request {i}")
            assert r.status_code == 200
        assert fake.recv_all(0.5) == []  # not one frame reached it
    finally:
        fake.close()


def test_a_real_worker_with_a_wrong_key_never_appears(
        keyed: tuple[GatewayProc, WorkerProc], keys: Path, tiny_model_dir: Path) -> None:
    gw, _ = keyed
    with WorkerProc(tiny_model_dir, gw.engine_address,
                    "--link-secret-key", str(keys / "intruders" / "intruder.key_secret"),
                    "--link-gateway-key", str(keys / "gateway" / "gateway.key")) as bad:
        deadline = time.monotonic() + 120
        while not any(e.get("msg") == "model loaded" for e in bad.log_lines()):
            assert time.monotonic() < deadline and bad.popen.poll() is None, bad.output()
            time.sleep(0.2)
        for _ in range(15):  # 3 s after it began to say Hello
            assert worker_count(gw) == 1
            time.sleep(0.2)
        assert complete(gw).status_code == 200
        assert not any(e.get("event") == "request_start" for e in bad.log_lines())
