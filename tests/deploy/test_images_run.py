"""The two images, run for real with podman: the gateway and worker containers of
deploy/docker-compose.yml (its images, commands, environment and secrets) answer a completion.

This test never builds an image. It is skipped unless podman is installed, both images exist
locally (`make images`, see the Makefile) and podman can run a container here, so `make test`
stays fast on a machine without them. Where podman needs settings to run at all (a runtime, a
cgroup manager, no default ulimits: CONTAINERS_CONF), set them in the environment; PODMAN may
name another command line for podman; GATEWAY_IMAGE and WORKER_IMAGE other tags than compose's.

What differs from compose, and why: host networking (what runs everywhere podman does; compose's
own network needs a bridge), so the service names and 0.0.0.0 become 127.0.0.1 and ports 8000 and
5557 free loopback ports; secrets and the authorized-keys folder are files deploy/make-secrets.sh
made in a temp folder, bind-mounted read-only where compose mounts them. The worker starts once
the gateway's image healthcheck passes (compose's depends_on: service_healthy), and both images'
healthchecks must pass once the gateway is ready.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.deploy.compose_files import DEPLOY, project
from tests.procs import free_port

PODMAN = shlex.split(os.environ.get("PODMAN", "podman"))
SERVICES = project()["services"]
IMAGES = {"gateway": os.environ.get("GATEWAY_IMAGE", SERVICES["gateway"]["image"]),
          "worker": os.environ.get("WORKER_IMAGE", SERVICES["worker"]["image"])}


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)


def why_not_runnable() -> str | None:
    """None when the test can run here, else the reason to skip it."""
    if shutil.which(PODMAN[0]) is None:
        return f"{PODMAN[0]} is not installed"
    missing = [i for i in IMAGES.values() if podman("image", "exists", i).returncode != 0]
    if missing:
        return f"images not built (make images): {', '.join(missing)}"
    trial = podman("run", "--rm", "--network", "host", "--no-healthcheck", IMAGES["gateway"],
                   "true")
    if trial.returncode != 0:
        errors = [line for line in trial.stderr.splitlines() if line.startswith("Error")]
        return ("podman cannot run a container here (settings in CONTAINERS_CONF?): "
                + (errors or [trial.stderr.strip()])[-1][-400:])
    return None


def secrets_dir(tmp_path: Path) -> Path:
    out = tmp_path / "secrets"
    subprocess.run(["bash", str(DEPLOY / "make-secrets.sh"), str(out)], check=True,
                   env={**os.environ, "PYTHON": sys.executable}, capture_output=True, timeout=60)
    return out


def run_args(name: str, secrets: Path, env: dict[str, str]) -> list[str]:
    """`podman run` for a compose service: its image, command, environment with `env` over it,
    its secrets at /run/secrets/NAME and its ./secrets/ volumes, all read-only."""
    svc, files = SERVICES[name], project()["secrets"]
    args = ["run", "-d", "--name", container(name), "--network", "host"]
    for secret in svc.get("secrets", []):
        local = secrets / files[secret]["file"].removeprefix("./secrets/")
        args += ["-v", f"{local}:/run/secrets/{secret}:ro"]
    for volume in svc.get("volumes", []):
        src, dst = volume.split(":")[:2]
        assert src.startswith("./secrets/"), volume
        args += ["-v", f"{secrets / src.removeprefix('./secrets/')}:{dst}:ro"]
    for key, value in {**{k: str(v) for k, v in svc["environment"].items()}, **env}.items():
        args += ["-e", f"{key}={value}"]
    return [*args, IMAGES[name], *svc["command"]]


def container(name: str) -> str:
    return f"kestrel-test-{name}-{os.getpid()}"


def logs(name: str, tail: int = 3000) -> str:
    out = podman("logs", container(name))
    return f"--- {name} ---\n{(out.stdout + out.stderr)[-tail:]}"


def running(name: str) -> bool:
    state = podman("inspect", "--format", "{{.State.Running}}", container(name))
    return state.stdout.strip() == "true"


def wait_for(what: str, check: Any, names: list[str], timeout: float) -> float:
    """Poll `check()` until true; the seconds it took. Fails early if a container exited."""
    start = time.monotonic()
    while not check():
        for name in names:
            assert running(name), f"{name} exited while waiting for {what}\n{logs(name)}"
        assert time.monotonic() - start < timeout, f"no {what} in {timeout} s\n" + "\n".join(
            logs(n) for n in names)
        time.sleep(0.5)
    return time.monotonic() - start


def healthcheck(name: str) -> bool:
    return podman("healthcheck", "run", container(name), timeout=30).returncode == 0


def ready(base: str) -> bool:
    try:
        return httpx.get(base + "/health/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_images_serve_a_completion(tmp_path: Path) -> None:
    reason = why_not_runnable()
    if reason is not None:
        pytest.skip(reason)
    secrets = secrets_dir(tmp_path)
    http, link = free_port(), free_port()
    gateway_env = {"PORT": str(http), "KESTREL_HOST": "127.0.0.1",
                   "KESTREL_ENGINE_ADDRESS": f"tcp://127.0.0.1:{link}"}
    worker_env = {"KESTREL_GATEWAY_ADDRESS": f"tcp://127.0.0.1:{link}"}
    base = f"http://127.0.0.1:{http}"
    started: list[str] = []
    try:
        t0 = time.monotonic()
        run = podman(*run_args("gateway", secrets, gateway_env))
        assert run.returncode == 0, run.stderr
        started.append("gateway")
        wait_for("healthy gateway", lambda: healthcheck("gateway"), started, timeout=60)
        run = podman(*run_args("worker", secrets, worker_env))
        assert run.returncode == 0, run.stderr
        started.append("worker")
        wait_for("/health/ready", lambda: ready(base), started, timeout=180)
        print(f"\nready {time.monotonic() - t0:.1f} s after the gateway container started")
        assert healthcheck("gateway") and healthcheck("worker"), "\n".join(map(logs, started))

        key = (secrets / "api_keys").read_text().split()[0]
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        model = client.models.list().data[0].id
        raw = client.completions.with_raw_response.create(
            model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
        assert raw.http_response.status_code == 200
        completion = raw.parse()
        assert completion.choices[0].text.strip(), completion
        assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 4

        # The fast path, as on a host with a compiler: the image carries no compiler, so each
        # kernel is one its build stage made for the best level this CPU runs (issue 42: the
        # image once fell back to torch's INT8 and gathered attention).
        worker_log = logs("worker", tail=20000)
        assert "no C++ compiler" not in worker_log, worker_log
        for kernel in ("int_dot", "paged_attention", "decode_stack"):
            assert f"{kernel} kernel: the prebuilt" in worker_log, worker_log
        assert "reads the paged KV cache in place" in worker_log, worker_log
        assert "through the C++ decode stack" in worker_log, worker_log

        # Stopped as compose stops them (SIGTERM, a grace period): each drains and exits 0.
        for name in reversed(started):
            assert podman("stop", "-t", "45", container(name), timeout=60).returncode == 0
            code = podman("inspect", "--format", "{{.State.ExitCode}}", container(name))
            assert code.stdout.strip() == "0", f"{name} exited {code.stdout.strip()}\n{logs(name)}"
    finally:
        for name in started:
            podman("rm", "-f", "-t", "0", container(name), timeout=60)
