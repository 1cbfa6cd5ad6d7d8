"""Issue 39, end to end: `kestrel serve --models-dir DIR` over a folder the test writes (two
names for the embedded SmolLM2 GGUF, and a file that is no GGUF), through the real launcher,
gateway and worker processes and the official openai client: models listed with their status,
loaded by their first request, at most --models-max loaded while requests for two models race,
a failing model named in its 503, loads and unloads by hand, none under its requests (and
/openapi.json describing those two routes, which schemathesis holds the server to), and the
idle ones unloaded with their processes gone."""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

from engine_worker.model.loader import embedded_gguf_path
from tests.e2e.test_kestrel_serve import ServeProc

pytestmark = pytest.mark.smollm
PROMPT = "The capital of France is"


def folder(tmp: Path) -> Path:
    models = tmp / "models"
    models.mkdir()
    for name in ("alpha", "beta"):
        (models / f"{name}.gguf").symlink_to(embedded_gguf_path())
    (models / "broken.gguf").write_bytes(b"GGUF\x03\x00")  # a header cut short
    return models


def worker_pids(serve: ServeProc) -> list[int]:
    """The worker processes the server started that are alive now."""
    assert serve.popen is not None
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == serve.popen.pid and b"engine_worker.main" in cmd and state != "Z":
            pids.append(int(proc.name))
    return pids


def statuses(serve: ServeProc) -> dict[str, str]:
    data = httpx.get(serve.base_url + "/v1/models", timeout=10).json()["data"]
    return {d["id"]: d["status"] for d in data}


def complete(serve: ServeProc, model: str, max_tokens: int = 6) -> openai.types.Completion:
    client = openai.OpenAI(base_url=serve.base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=180)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=0)


def wait_for(check, timeout: float = 60) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    models = folder(tmp_path_factory.mktemp("models-dir"))
    with ServeProc("--models-dir", str(models), "--models-max", "1", "--kv-cache-mb", "64",
                   "--threads", "1", "--sse-keepalive-s", "0.5") as srv:
        srv.wait_ready(timeout=60)
        yield srv


def test_v1_models_lists_every_model_of_the_folder_with_its_status(served: ServeProc) -> None:
    listed = statuses(served)
    assert set(listed) == {"alpha", "beta", "broken"}
    assert set(listed.values()) <= {"loaded", "loading", "unloaded"}


MODEL_ROUTES = {"POST /models/load", "POST /models/unload"}


def test_openapi_describes_the_load_and_unload_routes(served: ServeProc) -> None:
    doc = httpx.get(served.base_url + "/openapi.json", timeout=10).json()
    assert {"/models/load", "/models/unload"} <= set(doc["paths"])


def test_schemathesis_holds_the_load_and_unload_routes_to_the_document(
        served: ServeProc) -> None:
    """Drawn bodies (valid and not; derandomized) answered as documented: a status the route
    lists, the body in its schema, a bad body refused, never a 5xx. A drawn model id is no id
    of the folder (404), so nothing is loaded or unloaded here."""
    schema = schemathesis.openapi.from_url(served.base_url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations() if r.ok().label in MODEL_ROUTES]
    assert {op.label for op in operations} == MODEL_ROUTES
    for operation, mode in itertools.product(operations, schemathesis.GenerationMode):
        @given(case=operation.as_strategy(mode))  # without a mode it draws valid bodies only
        @settings(max_examples=20, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            case.call_and_validate(timeout=30, checks=[
                checks.not_a_server_error, checks.status_code_conformance,
                checks.content_type_conformance, checks.response_schema_conformance,
                checks.negative_data_rejection])

        run()
    assert set(statuses(served).values()) == {"unloaded"}


def test_a_request_for_an_unloaded_model_loads_it_and_is_answered(served: ServeProc) -> None:
    out = complete(served, "alpha")
    assert out.model == "alpha" and out.choices[0].text.strip().startswith("Paris")
    assert statuses(served)["alpha"] == "loaded" and len(worker_pids(served)) == 1
    assert "kestrel_model_load_seconds_count" in httpx.get(served.base_url + "/metrics").text


def test_models_max_1_switches_under_concurrent_requests_for_two_models(
        served: ServeProc) -> None:
    most, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            most[0] = max(most[0], len(worker_pids(served)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    asked = ["alpha", "beta", "alpha", "beta"]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
            answers = list(pool.map(lambda m: complete(served, m), asked))
    finally:
        done.set()
        watcher.join()
    assert [a.model for a in answers] == asked  # none lost, none answered by the other model
    assert all(a.choices[0].text.strip().startswith("Paris") for a in answers)
    assert most[0] == 1  # never two models' workers at once


def test_a_stream_for_an_unloaded_model_is_kept_alive_while_it_loads(served: ServeProc) -> None:
    httpx.post(served.base_url + "/models/load", json={"model": "alpha"}, timeout=120)
    assert statuses(served)["beta"] == "unloaded"
    lines = []
    with httpx.stream("POST", served.base_url + "/v1/completions", json={
            "model": "beta", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "stream": True}, timeout=180) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: {"))
    assert any(line.startswith(": keep-alive") for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]" and '"model":"beta"' in lines[first_data].replace(" ", "")


def test_a_stream_for_a_model_that_fails_to_load_gets_the_error_as_an_event(
        served: ServeProc) -> None:
    with httpx.stream("POST", served.base_url + "/v1/completions", json={
            "model": "broken", "prompt": PROMPT, "max_tokens": 4, "stream": True},
            timeout=120) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert '"model_load_failed"' in lines[0] and lines[-1] == "data: [DONE]"


def test_a_model_that_fails_to_load_answers_503_naming_why(served: ServeProc) -> None:
    out = httpx.post(served.base_url + "/v1/completions", json={
        "model": "broken", "prompt": PROMPT, "max_tokens": 4}, timeout=120)
    assert out.status_code == 503, out.text
    error = out.json()["error"]
    assert error["code"] == "model_load_failed" and "broken" in error["message"]
    assert "GGUF" in error["message"] and "Traceback" not in error["message"]
    assert complete(served, "alpha").model == "alpha"  # the server goes on


def test_loads_and_unloads_by_hand_and_never_under_a_request(served: ServeProc) -> None:
    base = served.base_url
    assert httpx.post(base + "/models/load", json={"model": "beta"},
                      timeout=120).json() == {"model": "beta", "status": "loaded"}
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=180)
    stream = client.completions.create(model="beta", prompt=PROMPT, max_tokens=200,
                                       temperature=0, stream=True, extra_body={
                                           "ignore_eos": True})
    first = next(iter(stream))  # running now
    busy = httpx.post(base + "/models/unload", json={"model": "beta"}, timeout=30)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"
    text = first.choices[0].text + "".join(c.choices[0].text for c in stream)
    assert text
    out = httpx.post(base + "/models/unload", json={"model": "beta"}, timeout=30)
    assert out.status_code == 200 and out.json()["status"] == "unloaded"
    wait_for(lambda: not worker_pids(served))
    # a request right behind an unload waits for the process to go, then loads it again
    httpx.post(base + "/models/load", json={"model": "beta"}, timeout=120)
    httpx.post(base + "/models/unload", json={"model": "beta"}, timeout=30)
    assert complete(served, "beta").model == "beta"
    unknown = httpx.post(base + "/models/load", json={"model": "gamma"}, timeout=30)
    assert unknown.status_code == 404


def test_an_idle_model_is_unloaded_and_its_process_goes(tmp_path: Path) -> None:
    with ServeProc("--models-dir", str(folder(tmp_path)), "--sleep-idle-seconds", "1",
                   "--kv-cache-mb", "64", "--threads", "1") as srv:
        srv.wait_ready(timeout=60)
        assert complete(srv, "alpha").model == "alpha"
        wait_for(lambda: not worker_pids(srv), timeout=30)
        assert set(statuses(srv).values()) == {"unloaded"}
        assert 'kestrel_model_unloads_total{reason="idle"} 1.0' in \
            httpx.get(srv.base_url + "/metrics").text
