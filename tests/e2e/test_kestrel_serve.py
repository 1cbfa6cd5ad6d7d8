"""`kestrel serve MODEL [flags]` end to end: one command, real gateway and worker processes, the
official openai client, and each vLLM-named flag checked by what it does (not by its parse)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from kestrel.serve import link_dir
from tests.procs import ROOT, GatewayProc, Proc, free_port

KEY, KEY2 = "k", "k2"


class ServeProc(Proc):
    """`python -m kestrel.cli serve ...` (what the `kestrel` script runs) on free ports."""

    name = "serve"

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # No --engine-address: the link is serve's default, an ipc socket in a private folder.
        super().__init__([sys.executable, "-m", "kestrel.cli", "serve", *flags, "--host",
                          "127.0.0.1", "--port", str(self.port)])

    wait_ready = GatewayProc.wait_ready

    def loaded(self) -> dict:
        return next(e for e in self.log_lines() if e.get("msg") == "model loaded")


def kv_tokens(model_dir: Path, budget: int, block_size: int = 16, element: int = 2) -> int:
    """KV capacity in tokens for a cache of `budget` bytes (K and V, every layer) whose
    elements are `element` bytes (the default cache: bfloat16)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * element
    return budget // (per_token * block_size) * block_size


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable")


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[ServeProc]:
    with ServeProc(str(tiny_model_dir), "--served-model-name", "a", "b", "--api-key", KEY,
                   "--api-key", KEY2, "--max-num-seqs", "2", "--max-queue", "0",
                   "--max-model-len", "96", "--enable-prefix-caching",
                   "--kv-cache-memory", "4MiB", "--dtype", "float32") as srv:
        srv.wait_ready()
        yield srv


def client(srv: ServeProc, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0)


def test_openai_client_end_to_end_under_the_served_name(served: ServeProc) -> None:
    chat = client(served).chat.completions.create(
        model="a", max_tokens=5, messages=[{"role": "user", "content": "hello"}])
    assert chat.model == "a" and chat.usage.completion_tokens >= 1
    stream = client(served).completions.create(model="a", prompt="hello", max_tokens=4,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
    chunks = list(stream)
    # 4 tokens streamed (a token that ends inside a UTF-8 character has no text of its own)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert 1 <= sum(bool(c.choices and c.choices[0].text) for c in chunks) <= 4


def connect_as(uid: int, path: Path) -> int:
    """In a forked child running as `uid`, connect a Unix socket to `path`: 0 if it connected,
    13 if refused for permission, 1 otherwise."""
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, only os._exit
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(path))
            code = 0
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_the_link_is_a_socket_no_other_user_can_reach(served: ServeProc) -> None:
    """Issue 23: a keyless loopback TCP link let any local process join as a worker. The
    default link is an ipc socket in a 0700 folder of this user's; another user's process
    cannot even connect to it (run as `nobody`, where the tests run as root)."""
    sock = link_dir(os.environ) / f"engine-{served.port}.sock"
    assert stat.S_ISSOCK(sock.stat().st_mode)
    folder = sock.parent.stat()
    assert folder.st_uid == os.getuid() and stat.S_IMODE(folder.st_mode) == 0o700
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user")
    assert connect_as(0, sock) == 0  # the socket takes connections...
    assert connect_as(65534, sock) == 13  # ...but not from another user (nobody)


def test_served_model_names_first_is_the_id_the_others_aliases(served: ServeProc) -> None:
    models = {m.id: m for m in client(served).models.list()}
    assert set(models) == {"a", "b"}
    assert models["b"].model_extra["root"] == "a"
    via_alias = client(served).completions.create(model="b", prompt="hi", max_tokens=2)
    assert via_alias.model == "a"  # responses carry the first name, like vLLM's
    with pytest.raises(openai.NotFoundError):
        client(served).completions.create(model="tiny-llama-seed0", prompt="hi", max_tokens=2)


def test_api_key_is_required_and_repeatable(served: ServeProc) -> None:
    assert httpx.get(served.base_url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(served, "wrong").models.list()
    assert [m.id for m in client(served, KEY2).models.list()] == ["a", "b"]


def test_max_model_len_refuses_a_longer_request(served: ServeProc) -> None:
    assert {m.model_extra["max_model_len"] for m in client(served).models.list()} == {96}
    with pytest.raises(openai.BadRequestError) as exc:
        client(served).completions.create(model="a", prompt="hello", max_tokens=200)
    assert exc.value.code == "context_length_exceeded"


def test_max_num_seqs_is_the_admission_capacity(served: ServeProc) -> None:
    """Two sequences run (max_num_seqs 2, no gateway queue): a third request gets 429 while
    they are still streaming, and both of them then finish. The two last ~0.3 s on the tiny
    model: a test process kept off the CPU that long (another test process beside it) could
    send the third after they ended, so a pair that ended first is tried again, twice at most;
    a server that admits the third every time fails."""
    body = {"model": "a", "prompt": "x", "max_tokens": 90, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=served.base_url, headers=headers, timeout=60) as http:
        for _ in range(3):
            with http.stream("POST", "/v1/completions", json=body) as s1, \
                    http.stream("POST", "/v1/completions", json=body) as s2:
                lines1, lines2 = s1.iter_lines(), s2.iter_lines()
                next(line for line in lines1 if line.startswith("data:"))
                next(line for line in lines2 if line.startswith("data:"))
                third = http.post("/v1/completions", json={**body, "stream": False})
                rest = [list(lines1), list(lines2)]
            assert [[x for x in lines if x][-1] for lines in rest] == ["data: [DONE]"] * 2
            if third.status_code == 429:
                break
    assert third.status_code == 429, third.text


def test_prefix_caching_serves_a_repeated_prompt_from_cache(served: ServeProc) -> None:
    prompt = " ".join(["river stone"] * 20)  # 40 tokens: two full 16-token blocks
    first = client(served).completions.create(model="a", prompt=prompt, max_tokens=1)
    again = client(served).completions.create(model="a", prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens >= 32
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


def test_kv_cache_memory_in_bytes_sizes_the_cache(served: ServeProc,
                                                  tiny_model_dir: Path) -> None:
    assert served.loaded()["kv_capacity_tokens"] == kv_tokens(tiny_model_dir, 4 * 2**20)


@pytest.mark.smollm
def test_gguf_named_by_its_stem_no_prefix_cache_and_a_fraction_of_memory(cache_dir: Path) -> None:
    """The embedded GGUF file given by path: served as its stem without the quant suffix (not
    the cache folder's hashed name); --no-enable-prefix-caching turns hits off; the KV budget
    as a fraction is of the host's MemAvailable."""
    from engine_worker.config import DTYPES
    from engine_worker.model.loader import embedded_gguf_path, resolve_checkpoint

    gguf = embedded_gguf_path()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    dtype = ["--dtype", "auto"] if "auto" in DTYPES else []  # issue 10 adds "auto"
    available = mem_available()
    with ServeProc(str(gguf), "--no-enable-prefix-caching", "--kv-cache-memory", "0.002",
                   "--cache-dir", str(cache_dir), *dtype) as srv:
        srv.wait_ready(timeout=180)
        oai = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in oai.models.list()] == ["SmolLM2-135M-Instruct"]
        prompt = " ".join(["river stone"] * 20)
        for _ in range(2):
            out = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                         max_tokens=1)
        assert out.usage.prompt_tokens >= 32
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        capacity = srv.loaded()["kv_capacity_tokens"]
    expected = kv_tokens(resolve_checkpoint(str(gguf), cache_dir), int(0.002 * available))
    assert 0.5 * expected <= capacity <= 2 * expected, (capacity, expected)


def run_serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kestrel.cli", "serve", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("flag", ["--no-such-flag", "--api-k", "--served-model"])
def test_unknown_or_abbreviated_flag_exits_2_naming_it(flag: str) -> None:
    done = run_serve("default", flag, "x")
    assert done.returncode == 2
    assert f"unrecognized argument {flag} " in done.stderr


def test_vllm_flag_we_do_not_support_says_so() -> None:
    done = run_serve("default", "--gpu-memory-utilization", "0.9")
    assert done.returncode == 2
    assert "--gpu-memory-utilization is a vLLM flag kestrel does not support" in done.stderr
    assert "--kv-cache-memory" in done.stderr


def test_help_groups_flags_by_process() -> None:
    out = run_serve("--help").stdout
    sections = ["model:", "both processes:", "gateway (", "worker ("]
    positions = [out.index(s) for s in sections]
    assert positions == sorted(positions)
    assert out.index("--api-key") > positions[2] and out.index("--max-num-seqs") > positions[3]


def test_a_worker_that_cannot_load_its_model_stops_the_server(tmp_path: Path) -> None:
    done = run_serve(str(tmp_path / "missing"), "--port", str(free_port()))
    assert done.returncode == 1, done.stderr[-2000:]




def test_two_api_server_processes_both_get_the_worker(tiny_model_dir: Path) -> None:
    """`--api-server-count 2`: the worker joins both processes' links, so both become ready and
    20 chats on fresh connections (the kernel spreads them over the two) all get 200; process
    0's link alone left process 1 without a worker, and its share of chats got 503."""
    with ServeProc(str(tiny_model_dir), "--api-server-count", "2", "--max-num-seqs", "4",
                   "--dtype", "float32") as srv:
        srv.wait_ready()
        ready: set[int] = set()
        deadline = time.monotonic() + 60
        while len(ready) < 2 and time.monotonic() < deadline:
            r = httpx.get(srv.base_url + "/health", timeout=5)  # a fresh connection each time
            if r.status_code == 200:
                ready.add(r.json()["api_server"]["index"])
        assert ready == {0, 1}, srv.output()[-3000:]
        model = httpx.get(srv.base_url + "/v1/models", timeout=5).json()["data"][0]["id"]

        def chat(i: int) -> int:
            with httpx.Client(base_url=srv.base_url, timeout=120) as http:  # its own connection
                return http.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"hello {i}"}]}).status_code

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(chat, range(20))) == [200] * 20
