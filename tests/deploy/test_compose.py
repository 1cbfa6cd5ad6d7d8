"""deploy/docker-compose*.yml: valid against the Compose specification's JSON schema (vendored in
tests/deploy/compose-spec.json), every command and variable one the process accepts, and the
operator-facing problems they once had cannot come back: no restart policies, no worker
healthcheck, a start order that deadlocks on readiness, the 30 s drain cut by a 10 s stop grace,
unpinned images, Grafana's default login, secrets named but not defined, no GPU variant."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gateway.main import DRAIN_BACKSTOP_S
from tests.deploy.compose_files import BASE, DEPLOY, GPU, load, project, seconds
from tests.deploy.dockerfile import Dockerfile
from tests.deploy.process_settings import check_command

SCHEMA = Path(__file__).with_name("compose-spec.json")
KESTREL = ("gateway", "worker")


def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("path", [BASE, GPU], ids=lambda p: p.name)
def test_compose_file_matches_the_compose_spec_schema(path: Path) -> None:
    errors = sorted(validator().iter_errors(load(path)), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_the_merged_gpu_project_matches_the_schema_and_the_schema_can_fail() -> None:
    v = validator()
    assert not list(v.iter_errors(project(gpu=True)))
    broken = project()
    broken["services"]["worker"]["restart_policy"] = "always"  # not a compose key
    broken["services"]["gateway"]["stop_grace_period"] = 45  # must be a duration string
    assert len(list(v.iter_errors(broken))) >= 2


def image_env(service: dict[str, Any]) -> dict[str, str]:
    return Dockerfile(DEPLOY.parent / service["build"]["dockerfile"]).env()


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("name", KESTREL)
def test_commands_and_environment_are_ones_the_process_accepts(name: str, gpu: bool) -> None:
    svc = project(gpu)["services"][name]
    env = {**image_env(svc), **{k: str(v) for k, v in svc["environment"].items()}}
    cfg = check_command(svc["command"], env)
    if name == "worker":
        assert cfg.device == ("cuda" if gpu else "cpu")
        assert cfg.gateway_address == "tcp://gateway:5557"
    else:
        assert cfg.engine_address == "tcp://0.0.0.0:5557" and cfg.host == "0.0.0.0"


def test_worker_image_and_override_build_the_right_torch() -> None:
    cpu, gpu = (project(g)["services"]["worker"] for g in (False, True))
    assert cpu["build"]["args"]["TORCH_VARIANT"] == "cpu"
    assert re.fullmatch(r"cu\d{3}", gpu["build"]["args"]["TORCH_VARIANT"])
    assert cpu["image"] != gpu["image"]
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device.get("count", device.get("device_ids")) and "deploy" not in cpu


def test_start_order_has_no_readiness_deadlock() -> None:
    services = project()["services"]
    dep = services["worker"]["depends_on"]["gateway"]
    assert dep["condition"] == "service_healthy"
    # The gateway is ready only once a worker joined: a healthcheck on readiness would keep
    # the worker waiting for ever. It must be the liveness check.
    test = services["gateway"]["healthcheck"]["test"]
    assert test == ["CMD", *Dockerfile(DEPLOY / "Dockerfile.gateway").exec_form("HEALTHCHECK")]
    assert "ready" not in " ".join(test)
    assert test[-1] == "gateway"  # deploy/healthcheck.py gateway: GET /health/live


@pytest.mark.parametrize("name", KESTREL)
def test_services_restart_and_have_healthchecks(name: str) -> None:
    services = project()["services"]
    for svc in services.values():
        assert svc["restart"] in ("always", "unless-stopped", "on-failure")
    check = services[name]["healthcheck"]
    assert check["test"][0] == "CMD" and check["test"][1:3] == ["python", "deploy/healthcheck.py"]
    assert seconds(check["interval"]) > 0 and check["retries"] >= 1


@pytest.mark.parametrize("name", KESTREL)
def test_stop_grace_outlasts_the_drain(name: str) -> None:
    svc = project()["services"][name]
    env = {**image_env(svc), **{k: str(v) for k, v in svc["environment"].items()}}
    drain = check_command(svc["command"], env).drain_timeout_s
    backstop = DRAIN_BACKSTOP_S if name == "gateway" else 0.0
    # Docker's default grace is 10 s: without this the 30 s drain is cut short by SIGKILL.
    assert seconds(svc.get("stop_grace_period", "10s")) > drain + backstop + 5


def test_third_party_images_are_pinned() -> None:
    for name in ("prometheus", "grafana"):
        image = project()["services"][name]["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag and re.match(r"v?\d+\.\d+\.\d+$", tag), image


def test_grafana_has_no_default_login() -> None:
    grafana = project()["services"]["grafana"]
    env = grafana["environment"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    path = env["GF_SECURITY_ADMIN_PASSWORD__FILE"]
    assert path.startswith("/run/secrets/") and path.rsplit("/", 1)[1] in grafana["secrets"]
    assert str(env.get("GF_AUTH_ANONYMOUS_ENABLED")).lower() == "false"


def test_every_secret_used_is_defined_and_api_and_link_keys_are_secrets() -> None:
    doc = project(gpu=True)
    defined = doc["secrets"]
    for name, svc in doc["services"].items():
        for secret in svc.get("secrets", []):
            assert secret in defined, f"{name} uses undefined secret {secret}"
        words = [*svc.get("command", []), *map(str, svc.get("environment", {}).values())]
        for word in words:  # every /run/secrets/X a process reads is a secret it is given
            if word.startswith("/run/secrets/"):
                assert word.split("/")[3] in svc.get("secrets", []), (name, word)
    for spec in defined.values():
        assert spec["file"].startswith("./secrets/")  # made by make-secrets.sh, git-ignored
    gw, wk = (doc["services"][n]["command"] for n in KESTREL)
    assert gw[gw.index("--api-key-file") + 1].startswith("/run/secrets/")
    assert gw[gw.index("--link-secret-key") + 1].startswith("/run/secrets/")
    assert wk[wk.index("--link-secret-key") + 1].startswith("/run/secrets/")
    assert wk[wk.index("--link-gateway-key") + 1].startswith("/run/secrets/")


def test_the_engine_link_port_is_not_published() -> None:
    ports = [str(p) for p in project()["services"]["gateway"]["ports"]]
    assert ports == ["${KESTREL_PORT:-8000}:8000"]  # the host's side overridable (issue 42)


def test_every_published_port_can_be_moved_on_the_host() -> None:
    published = {name: [str(p) for p in svc.get("ports", [])]
                 for name, svc in project()["services"].items() if svc.get("ports")}
    for name, ports in published.items():
        for port in ports:
            host, _, container = port.rpartition(":")
            assert host.startswith("${") and host.endswith(f":-{container}}}"), (name, port)


def test_the_settings_check_rejects_what_a_process_would_not_accept() -> None:
    ok = ["python", "-m", "engine_worker.main", "--drain-timeout-s", "30"]
    check_command(ok, {"KESTREL_KV_CACHE_MB": "64"})
    with pytest.raises(AssertionError, match="KESTREL_KV_CACHE_MIB"):
        check_command(ok, {"KESTREL_KV_CACHE_MIB": "64"})  # a misspelt variable is ignored
    with pytest.raises(SystemExit):
        check_command([*ok, "--drain-timeouts", "30"], {})  # argparse: unknown flag
    with pytest.raises(SystemExit):
        check_command(ok, {"KESTREL_DTYPE": "float8"})  # the config's own validation
    with pytest.raises(SystemExit):  # only issue 12's names are tolerated, not any --link-*
        check_command([*ok, "--link-gateway-keys", "/x"], {})


def test_the_worker_serves_the_model_its_image_converted() -> None:
    df = Dockerfile(DEPLOY / "Dockerfile.worker")
    convert = next(i.args for i in df.all("RUN") if "resolve_checkpoint" in i.args)
    built_into = re.search(r"resolve_checkpoint\('default', Path\('([^']+)'\)\)", convert)
    assert built_into is not None
    for gpu in (False, True):
        env = {**df.env(), **project(gpu)["services"]["worker"]["environment"]}
        # Same model and cache folder as the build: the container starts without converting.
        assert env["KESTREL_MODEL"] == "default"
        assert env["KESTREL_CACHE_DIR"] == built_into[1]
