"""What deploy/docker-compose.yml runs, run without Docker: the gateway's and the worker's
commands and environment (the image's ENV under the service's `environment`) started as local
processes, gated the way compose gates them (the worker starts once the gateway's healthcheck
passes), their healthchecks run as compose would run them, and a request served through the
official openai client with the API key make-secrets.sh made.

The mapping from container to this host, and nothing else, is changed:
  /app (WORKDIR, PYTHONPATH)        -> the repository root (cwd of every process)
  /run/secrets/NAME, volume paths   -> the files deploy/make-secrets.sh made in a temp folder
  0.0.0.0 and service host names    -> 127.0.0.1; ports 8000 and 5557 -> free loopback ports
  KESTREL_CACHE_DIR /models, KESTREL_MODEL default -> the test cache's tiny random Llama (fast;
                                       the image converts the real SmolLM2 at build time)
  `python`                          -> this interpreter
Issue 12's link-key flags are dropped while the code does not have them (process_settings.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.deploy.compose_files import DEPLOY, project
from tests.deploy.dockerfile import Dockerfile
from tests.procs import ROOT, Proc, free_port

ADDRESS = re.compile(r"tcp://([^:/]+):(\d+)")


class Mapping:
    def __init__(self, services: dict[str, Any], secrets_dir: Path, tiny: Path,
                 cache: Path) -> None:
        self.hosts = {"0.0.0.0", *services}
        self.ports = {"8000": str(free_port()), "5557": str(free_port())}
        self.paths: dict[str, str] = {"/app": str(ROOT)}
        self.tiny, self.cache = tiny, cache
        doc = project()
        for name, spec in doc["secrets"].items():
            self.paths[f"/run/secrets/{name}"] = str(secrets_dir / spec["file"][len("./secrets/"):])
        for svc in services.values():
            for vol in svc.get("volumes", []):
                src, dst = vol.split(":")[:2]
                if src.startswith("./secrets/"):
                    self.paths[dst] = str(secrets_dir / src[len("./secrets/"):])

    def value(self, text: str) -> str:
        text = ADDRESS.sub(lambda m: f"tcp://127.0.0.1:{self.ports.get(m[2], m[2])}"
                           if m[1] in self.hosts else m[0], text)
        for container, local in sorted(self.paths.items(), key=lambda p: -len(p[0])):
            if text == container or text.startswith(container + "/"):
                return local + text[len(container):]
        return text

    def env(self, service: dict[str, Any]) -> dict[str, str]:
        image = Dockerfile(DEPLOY.parent / service["build"]["dockerfile"]).env()
        env = {**image, **{k: str(v) for k, v in service.get("environment", {}).items()}}
        out = {k: self.value(v) for k, v in env.items()}
        if "KESTREL_HOST" in out:
            out["KESTREL_HOST"] = "127.0.0.1"  # tests bind loopback only
        if "PORT" in out:
            out["PORT"] = self.ports[out["PORT"]]
        if out.get("KESTREL_MODEL") == "default":
            out["KESTREL_MODEL"], out["KESTREL_CACHE_DIR"] = str(self.tiny), str(self.cache)
        return out

    def argv(self, command: list[str]) -> list[str]:
        assert command[0] == "python"
        return [sys.executable, *(self.value(a) for a in command[1:])]


def healthy(check: list[str], env: dict[str, str], mapping: Mapping) -> bool:
    assert check[0] == "CMD"
    run = subprocess.run(mapping.argv(check[1:]), cwd=ROOT, env={**os.environ, **env},
                         capture_output=True, timeout=30)
    return run.returncode == 0


def wait_healthy(check: list[str], env: dict[str, str], mapping: Mapping, proc: Proc,
                 timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.popen is not None and proc.popen.poll() is None, proc.output()[-3000:]
        if healthy(check, env, mapping):
            return
        time.sleep(0.3)
    raise TimeoutError(f"{check} not healthy:\n{proc.output()[-3000:]}")


@pytest.fixture()
def secrets_dir(tmp_path: Path) -> Path:
    out = tmp_path / "secrets"
    subprocess.run(["bash", str(DEPLOY / "make-secrets.sh"), str(out)], check=True,
                   env={**os.environ, "PYTHON": sys.executable}, capture_output=True, timeout=60)
    return out


@pytest.fixture()
def mapping(secrets_dir: Path, tiny_model_dir: Path, cache_dir: Path) -> Mapping:
    return Mapping(project()["services"], secrets_dir, tiny_model_dir, cache_dir)


def started(service: dict[str, Any], mapping: Mapping) -> Iterator[tuple[Proc, dict[str, str]]]:
    command, env = service["command"], mapping.env(service)
    proc = Proc(mapping.argv(command), env)
    with proc:
        yield proc, env


def test_compose_services_run_as_processes_and_serve(mapping: Mapping, secrets_dir: Path) -> None:
    services = project()["services"]
    gw_svc, wk_svc = services["gateway"], services["worker"]
    assert wk_svc["depends_on"]["gateway"]["condition"] == "service_healthy"
    for gw, gw_env in started(gw_svc, mapping):
        wait_healthy(gw_svc["healthcheck"]["test"], gw_env, mapping, gw, timeout=60)
        base = f"http://127.0.0.1:{gw_env['PORT']}"
        # Healthy (live) but not ready: no worker yet. Compose starts the worker now.
        assert httpx.get(base + "/health/ready", timeout=5).status_code == 503
        wk_env = mapping.env(wk_svc)
        assert not healthy(wk_svc["healthcheck"]["test"], wk_env, mapping)
        for wk, wk_env in started(wk_svc, mapping):
            wait_healthy(wk_svc["healthcheck"]["test"], wk_env, mapping, wk, timeout=120)
            deadline = time.monotonic() + 30
            while httpx.get(base + "/health/ready", timeout=5).status_code != 200:
                assert time.monotonic() < deadline, gw.output()[-3000:]
                time.sleep(0.2)
            key = (secrets_dir / "api_keys").read_text().split()[0]
            assert key.startswith("sk-kestrel-")
            client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
            model = client.models.list().data[0].id
            reply = client.chat.completions.create(
                model=model, max_tokens=8, temperature=0,
                messages=[{"role": "user", "content": "Hello"}])
            assert reply.choices[0].finish_reason in ("stop", "length")
            assert reply.usage is not None and reply.usage.completion_tokens > 0
            # The API key secret is in force: a wrong key is refused.
            wrong = openai.OpenAI(base_url=base + "/v1", api_key="sk-wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
            assert wk.stop(timeout=40) == 0
        assert gw.stop(timeout=45) == 0
