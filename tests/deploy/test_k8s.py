"""deploy/k8s: both overlays render (kustomize subset, checked against `kubectl kustomize` where
installed), every object validates against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict), every command and variable is one the process accepts, and each semantic check of
tests/deploy/k8s_checks.py passes on ours and fires on a copy that has the old problem."""

from __future__ import annotations

import base64
import copy
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy import k8s_checks as checks
from tests.deploy.kustomize import render
from tests.deploy.process_settings import check_command

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.32.0"
OVERLAYS = ("cpu", "gpu")
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def k8s_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/k8s copied, with the secrets make-secrets.sh makes (git ignores the real ones)."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(DEPLOY / "k8s", root, ignore=shutil.ignore_patterns("secrets"))
    subprocess.run(["bash", str(DEPLOY / "make-secrets.sh"), str(root / "base" / "secrets")],
                   env={**os.environ, "PYTHON": sys.executable}, check=True,
                   capture_output=True, timeout=60)
    return root


@pytest.fixture(scope="module")
def rendered(k8s_tree: Path) -> dict[str, list[Obj]]:
    return {o: render(k8s_tree / "overlays" / o) for o in OVERLAYS}


def test_overlays_render_the_expected_objects(rendered: dict[str, list[Obj]]) -> None:
    for overlay, objects in rendered.items():
        kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
        assert ("StatefulSet", "kestrel-worker") in kinds and (
            "Deployment", "kestrel-gateway") in kinds, overlay
        assert sum(k == "Secret" for k, _ in kinds) == 4
        _, wc = checks.the(objects, "engine_worker.main")
        assert wc["image"].endswith("-cpu" if overlay == "cpu" else "-cu130")


def normalise(objects: list[Obj]) -> dict[tuple[str, str], Obj]:
    out = {}
    for o in objects:
        o = copy.deepcopy(o)
        for key, value in o.get("data", {}).items():  # kubectl wraps long base64 lines
            o["data"][key] = "".join(str(value).split())
        out[(o["kind"], o["metadata"]["name"])] = o
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_render_matches_kubectl_kustomize(k8s_tree: Path, rendered: dict[str, list[Obj]],
                                          overlay: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the strict renderer alone is used")
    out = subprocess.run([kubectl, "kustomize", str(k8s_tree / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    theirs = normalise([d for d in yaml.safe_load_all(out) if d])
    assert theirs == normalise(rendered[overlay])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_matches_the_kubernetes_schema(rendered: dict[str, list[Obj]],
                                                    overlay: str) -> None:
    for obj in rendered[overlay]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_schema_check_can_fail(rendered: dict[str, list[Obj]]) -> None:
    sts = copy.deepcopy(checks.named(rendered["gpu"], "StatefulSet", "kestrel-worker"))
    assert sts is not None
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_and_environment_are_ones_the_process_accepts(
        rendered: dict[str, list[Obj]], overlay: str) -> None:
    for mod in ("gateway.main", "engine_worker.main"):
        _, c = checks.the(rendered[overlay], mod)
        assert all("value" in e for e in c.get("env", [])), "secrets come as files, not env"
        cfg = check_command(c["command"], checks.plain_env(c))
        if mod == "engine_worker.main":
            assert cfg.device == ("cpu" if overlay == "cpu" else "cuda")
            # The model and folder the image converted at build time (test_compose checks the
            # Dockerfile's side): no conversion at start.
            assert (cfg.model, cfg.cache_dir) == ("default", "/models")


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", checks.ALL, ids=lambda f: f.__name__)
def test_semantic_check_passes(rendered: dict[str, list[Obj]], overlay: str,
                               check: Callable[[list[Obj]], list[str]]) -> None:
    assert check(rendered[overlay]) == []


def test_gpu_workers_take_one_gpu_and_cpu_workers_none(rendered: dict[str, list[Obj]]) -> None:
    _, gpu = checks.the(rendered["gpu"], "engine_worker.main")
    _, cpu = checks.the(rendered["cpu"], "engine_worker.main")
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(cpu["resources"])


def sts_spec(objs: list[Obj]) -> Obj:
    return checks.named(objs, "StatefulSet", "kestrel-worker")["spec"]  # type: ignore[index]


def worker_container(objs: list[Obj]) -> Obj:
    return checks.the(objs, "engine_worker.main")[1]


def gateway_pod(objs: list[Obj]) -> Obj:
    return checks.the(objs, "gateway.main")[0]["spec"]["template"]["spec"]


def _hide_not_ready(objs: list[Obj]) -> None:  # the old single Service, readiness-gated
    checks.named(objs, "Service", "kestrel-link")["spec"].pop("publishNotReadyAddresses")


def _dial_http_service(objs: list[Obj]) -> None:
    env = worker_container(objs)["env"]
    next(e for e in env if e["name"] == "KESTREL_GATEWAY_ADDRESS")["value"] = \
        "tcp://kestrel-gateway:5557"


def _drop_service(objs: list[Obj]) -> None:
    objs.remove(checks.named(objs, "Service", "kestrel-worker"))


def _no_probes(objs: list[Obj]) -> None:
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        worker_container(objs).pop(probe)


def _soft_anti_affinity(objs: list[Obj]) -> None:
    sts_spec(objs)["template"]["spec"].pop("affinity")


def _missing_secret(objs: list[Obj]) -> None:
    objs.remove(checks.named(objs, "Secret", "kestrel-link-worker"))


def _plain_api_keys(objs: list[Obj]) -> None:
    cmd = checks.the(objs, "gateway.main")[1]["command"]
    i = cmd.index("--api-key-file")
    del cmd[i:i + 2]


def _open_link_port(objs: list[Obj]) -> None:
    pol = checks.named(objs, "NetworkPolicy", "kestrel-gateway")
    pol["spec"]["ingress"] = [{}]  # allow everything


def _no_requests(objs: list[Obj]) -> None:
    worker_container(objs)["resources"].pop("requests")


def _short_grace(objs: list[Obj]) -> None:
    gateway_pod(objs)["terminationGracePeriodSeconds"] = 30


MUTATIONS = {
    "readiness_deadlock": [_hide_not_ready, _dial_http_service],
    "statefulset_services": [_drop_service],
    "worker_probes": [_no_probes],
    "one_worker_per_gpu_host": [_soft_anti_affinity],
    "secrets_exist": [_missing_secret],
    "keys_from_secrets": [_plain_api_keys],
    "link_port_policy": [_open_link_port],
    "resource_requests": [_no_requests],
    "grace_outlasts_drain": [_short_grace],
}


@pytest.mark.parametrize("check", checks.ALL, ids=lambda f: f.__name__)
def test_semantic_check_fires_on_the_problem(rendered: dict[str, list[Obj]],
                                             check: Callable[[list[Obj]], list[str]]) -> None:
    for mutate in MUTATIONS[check.__name__]:
        objs = copy.deepcopy(rendered["gpu"])
        mutate(objs)
        assert check(objs), f"{check.__name__} missed {mutate.__name__}"


def test_generated_secrets_hold_the_made_keys(k8s_tree: Path,
                                              rendered: dict[str, list[Obj]]) -> None:
    secret = checks.named(rendered["cpu"], "Secret", "kestrel-link-public")
    assert secret is not None
    made = (k8s_tree / "base" / "secrets" / "link" / "gateway.key").read_bytes()
    assert base64.b64decode(secret["data"]["gateway.key"]) == made
    assert b"public-key" in made and b"secret-key" not in made
