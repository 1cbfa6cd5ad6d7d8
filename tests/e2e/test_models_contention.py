"""Issue 58, end to end: `kestrel serve --models-dir` under contention, through the real
launcher, gateway and worker processes, over two names for the tiny random Llama (a folder
with a config.json: a load takes seconds, not SmolLM2's twenty): a client that leaves while its
model loads leaves nothing behind, and a launcher killed while a model loads leaves no worker."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_kestrel_serve import ServeProc

CHAT = {"max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}


def tiny_folder(tmp: Path, tiny_model_dir: Path) -> Path:
    models = tmp / "models"
    models.mkdir()
    for name in ("alpha", "beta"):
        (models / name).symlink_to(tiny_model_dir, target_is_directory=True)
    return models


def workers_of(pid: int) -> list[int]:
    """The live worker processes whose parent is `pid`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and b"engine_worker.main" in cmd and state != "Z":
            found.append(int(proc.name))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def statuses(serve: ServeProc) -> dict[str, str]:
    data = httpx.get(serve.base_url + "/v1/models", timeout=10).json()["data"]
    return {d["id"]: d["status"] for d in data}


def wait_for(check, timeout: float = 60) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def chat(serve: ServeProc, model: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(serve.base_url + "/v1/chat/completions", json={**CHAT, "model": model},
                      timeout=timeout)


def serve_flags(models: Path, *more: str) -> list[str]:
    return ["--models-dir", str(models), "--models-max", "1", "--kv-cache-memory", "4MiB",
            "--dtype", "float32", "--threads", "1", "--drain-timeout-s", "2", *more]


@pytest.fixture()
def models(tmp_path: Path, tiny_model_dir: Path) -> Path:
    return tiny_folder(tmp_path, tiny_model_dir)


@pytest.fixture()
def served(models: Path) -> Iterator[ServeProc]:
    with ServeProc(*serve_flags(models)) as srv:
        srv.wait_ready(timeout=60)
        yield srv


def test_a_client_that_leaves_while_its_model_loads_leaves_nothing_behind(
        served: ServeProc) -> None:
    assert served.popen is not None
    with pytest.raises(httpx.TimeoutException):
        chat(served, "beta", timeout=0.5)  # gives up while beta's worker starts
    assert statuses(served)["beta"] == "loading"
    wait_for(lambda: statuses(served)["beta"] == "loaded")  # the load ends, nobody waiting
    out = httpx.post(served.base_url + "/models/unload", json={"model": "beta"}, timeout=30)
    assert out.status_code == 200, out.text
    started = time.monotonic()
    answer = chat(served, "alpha", timeout=60)
    assert answer.status_code == 200 and answer.json()["model"] == "alpha", answer.text
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("when", ["loading", "stuck"])
def test_the_launcher_ending_leaves_no_worker_within_the_drain_timeout_and_5_s(
        models: Path, sig: signal.Signals, when: str) -> None:
    """While its model loads, or once loaded and stuck (SIGSTOP: it handles no signal): SIGKILL
    runs no `finally` of the launcher's, the worker dies with it (PDEATHSIG); after SIGTERM the
    launcher's drain has ended the requests, and a worker that does not exit is killed."""
    with ServeProc(*serve_flags(models)) as srv:
        srv.wait_ready(timeout=60)
        assert srv.popen is not None
        threading.Thread(target=lambda: _ignore(chat, srv, "alpha"), daemon=True).start()
        wait_for(lambda: workers_of(srv.popen.pid), timeout=30)
        [worker] = workers_of(srv.popen.pid)
        if when == "stuck":
            wait_for(lambda: statuses(srv)["alpha"] == "loaded", timeout=60)
            os.kill(worker, signal.SIGSTOP)
        else:
            assert statuses(srv)["alpha"] == "loading"
        try:
            srv.popen.send_signal(sig)
            signalled = time.monotonic()
            wait_for(lambda: not alive(worker), timeout=2 + 5)  # drain timeout + 5 s
            assert time.monotonic() - signalled < 2 + 5
            srv.popen.wait(timeout=30)
        finally:
            if alive(worker):
                os.kill(worker, signal.SIGKILL)


def _ignore(fn, *args: object) -> None:  # noqa: ANN001
    try:
        fn(*args)
    except httpx.HTTPError:
        pass


def test_tokenizing_routes_load_nothing(served: ServeProc) -> None:
    """Before its first load a model's tokenizer is not at hand (409, no worker started);
    after its worker has gone, the one it announced answers, still with no worker."""
    assert served.popen is not None
    base = served.base_url
    asks = [("/tokenize", {"model": "beta", "prompt": "Hello world"}),
            ("/detokenize", {"model": "beta", "tokens": [1, 2]}),
            ("/v1/messages/count_tokens", {"model": "beta", "messages": [
                {"role": "user", "content": "Hello"}]})]
    for path, body in asks:
        out = httpx.post(base + path, json=body, timeout=30)
        assert out.status_code == 409, (path, out.text)
    assert not workers_of(served.popen.pid) and statuses(served)["beta"] == "unloaded"
    loaded = httpx.post(base + "/tokenize", json={"model": "alpha", "prompt": "Hello"})
    assert loaded.status_code == 409
    assert chat(served, "beta").status_code == 200  # beta's worker announced its tokenizer
    assert httpx.post(base + "/models/unload", json={"model": "beta"},
                      timeout=30).status_code == 200
    wait_for(lambda: not workers_of(served.popen.pid))
    for path, body in asks:
        out = httpx.post(base + path, json=body, timeout=30)
        assert out.status_code == 200, (path, out.text)
    assert httpx.post(base + "/tokenize", json=asks[0][1]).json()["count"] >= 2
    assert not workers_of(served.popen.pid) and statuses(served)["beta"] == "unloaded"


def test_loading_and_unloading_by_hand_needs_an_admin_key(models: Path) -> None:
    with ServeProc(*serve_flags(models, "--api-key", "tenant", "--api-key", "other",
                                "--admin-keys", "operator")) as srv:
        srv.wait_ready(timeout=60)
        assert srv.popen is not None
        for route in ("/models/load", "/models/unload"):
            out = httpx.post(srv.base_url + route, json={"model": "alpha"}, timeout=30,
                             headers={"Authorization": "Bearer tenant"})
            assert out.status_code == 403, out.text
            assert out.json()["error"]["code"] == "admin_key_required"
        assert not workers_of(srv.popen.pid)
        out = httpx.post(srv.base_url + "/models/load", json={"model": "alpha"}, timeout=60,
                         headers={"Authorization": "Bearer operator"})
        assert out.status_code == 200 and out.json()["status"] == "loaded", out.text
        out = httpx.post(srv.base_url + "/models/unload", json={"model": "alpha"}, timeout=30,
                         headers={"Authorization": "Bearer operator"})
        assert out.status_code == 200, out.text


def test_two_tenants_on_two_models_are_all_answered_and_no_load_is_wasted(models: Path) -> None:
    """--models-max 1, each tenant a steady stream of chats to its own model: every request
    answered (no 504), and every load serves a request before its model is unloaded (a load
    was once evicted in the millisecond it ended, by the other model's request)."""
    with ServeProc(*serve_flags(models, "--default-timeout-s", "60")) as srv:
        srv.wait_ready(timeout=60)
        statuses_seen: list[int] = []

        def tenant(model: str) -> None:
            for _ in range(2):
                statuses_seen.append(chat(srv, model, timeout=90).status_code)

        threads = [threading.Thread(target=tenant, args=(m,)) for m in ("alpha", "beta")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert statuses_seen == [200] * 4
        events = [(e.get("msg", ""), e.get("status")) for e in srv.log_lines()
                  if e.get("msg", "").startswith(("model ", "unloading model", "request ended"))]
        loads = unloads = 0
        served_since_load: bool | None = None
        for msg, status in events:
            if msg.startswith("model ") and " loaded in " in msg:
                loads, served_since_load = loads + 1, False
            elif msg.startswith("unloading model"):
                unloads += 1
                assert served_since_load, f"a load evicted before it served: {events}"
            elif msg == "request ended" and status == 200:
                served_since_load = True
        assert 2 <= loads <= 4 and unloads == loads - 1
