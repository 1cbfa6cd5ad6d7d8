"""Semantic checks of rendered Kubernetes manifests: each returns the problems it finds.

    problems = readiness_deadlock(objects)   # [] when fine

One function per problem deploy/k8s once had, so a test can show each fires on a manifest that
has the problem (tests/deploy/test_k8s.py mutates a good rendering) and stays quiet on ours.
"""

from __future__ import annotations

from typing import Any

from gateway.main import DRAIN_BACKSTOP_S
from tests.deploy.process_settings import check_command

Obj = dict[str, Any]


def by_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[Obj], kind: str, name: str) -> Obj | None:
    return next((o for o in by_kind(objects, kind) if o["metadata"]["name"] == name), None)


def workloads(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def containers(workload: Obj) -> list[Obj]:
    return workload["spec"]["template"]["spec"]["containers"]


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def plain_env(container: Obj) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def module(container: Obj) -> str:
    return container["command"][2]  # python -m MODULE ...


def the(objects: list[Obj], mod: str) -> tuple[Obj, Obj]:
    """The workload and container running `python -m mod`."""
    for w in workloads(objects):
        for c in containers(w):
            if c.get("command", [])[:3] == ["python", "-m", mod]:
                return w, c
    raise AssertionError(f"no workload runs {mod}")


def readiness_deadlock(objects: list[Obj]) -> list[str]:
    """Workers must reach the gateway before it is ready: the gateway turns ready only after a
    worker joined. Either the Service they dial lists not-ready pods, or readiness needs none."""
    gw, gc = the(objects, "gateway.main")
    _, wc = the(objects, "engine_worker.main")
    host, port = plain_env(wc)["KESTREL_GATEWAY_ADDRESS"][len("tcp://"):].rsplit(":", 1)
    svc = named(objects, "Service", host)
    if svc is None:
        return [f"workers dial {host!r}, which is not a Service"]
    problems = []
    if not selects(svc["spec"].get("selector"), pod_labels(gw)):
        problems.append(f"Service {host} does not select the gateway pods")
    [sport] = [p for p in svc["spec"]["ports"] if p["port"] == int(port)] or [None]
    engine_port = int(plain_env(gc)["KESTREL_ENGINE_ADDRESS"].rsplit(":", 1)[1])
    if sport is None:
        problems.append(f"Service {host} has no port {port}")
    else:
        target = sport.get("targetPort", sport["port"])
        named_ports = {p.get("name"): p["containerPort"] for p in gc.get("ports", [])}
        if named_ports.get(target, target) != engine_port:
            problems.append(f"Service {host}:{port} does not reach the engine port {engine_port}")
    ready_path = gc.get("readinessProbe", {}).get("httpGet", {}).get("path", "")
    if ready_path == "/health/ready" and not svc["spec"].get("publishNotReadyAddresses"):
        problems.append(f"Service {host} hides the not-ready gateway from the workers, and the "
                        "gateway is ready only after a worker joined: neither ever starts")
    return problems


def statefulset_services(objects: list[Obj]) -> list[str]:
    problems = []
    for sts in by_kind(objects, "StatefulSet"):
        name = sts["spec"].get("serviceName")
        svc = named(objects, "Service", name) if name else None
        if svc is None:
            problems.append(f"StatefulSet {sts['metadata']['name']}: Service {name!r} missing")
        elif svc["spec"].get("clusterIP") != "None" or not selects(
                svc["spec"].get("selector"), pod_labels(sts)):
            problems.append(f"Service {name} is not a headless Service for its pods")
    return problems


def worker_probes(objects: list[Obj]) -> list[str]:
    _, wc = the(objects, "engine_worker.main")
    missing = [p for p in ("startupProbe", "readinessProbe", "livenessProbe") if p not in wc]
    return [f"worker has no {p}" for p in missing]


def one_worker_per_gpu_host(objects: list[Obj]) -> list[str]:
    w, wc = the(objects, "engine_worker.main")
    gpus = wc.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if gpus is None:
        return []
    problems = [] if int(gpus) == 1 else [f"a worker takes {gpus} GPUs, not 1"]
    spec = w["spec"]["template"]["spec"]
    required = spec.get("affinity", {}).get("podAntiAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", [])
    spread = [t for t in spec.get("topologySpreadConstraints", [])
              if t["whenUnsatisfiable"] == "DoNotSchedule" and t["maxSkew"] == 1]
    if not any(t["topologyKey"] == "kubernetes.io/hostname"
               and selects(t["labelSelector"]["matchLabels"], pod_labels(w))
               for t in required):
        problems.append("no required anti-affinity keeps two GPU workers off one host")
    if not any(t["topologyKey"] == "kubernetes.io/hostname" for t in spread):
        problems.append("no hostname topology spread for the GPU workers")
    return problems


def secrets_exist(objects: list[Obj]) -> list[str]:
    data = {s["metadata"]["name"]: set(s.get("data", {})) | set(s.get("stringData", {}))
            for s in by_kind(objects, "Secret")}
    problems = []
    for w in workloads(objects):
        spec = w["spec"]["template"]["spec"]
        for vol in spec.get("volumes", []):
            if "secret" not in vol:
                continue
            name = vol["secret"]["secretName"]
            if name not in data:
                problems.append(f"volume {vol['name']}: Secret {name} missing")
                continue
            keys = [i["key"] for i in vol["secret"].get("items", [])]
            problems += [f"Secret {name} has no key {k}" for k in keys if k not in data[name]]
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] not in data.get(ref["name"], set()):
                    problems.append(f"env {e['name']}: Secret {ref['name']}/{ref['key']} missing")
            for m in c.get("volumeMounts", []):
                vol = next(v for v in spec.get("volumes", []) if v["name"] == m["name"])
                if "secret" in vol and m.get("subPath") and m["subPath"] not in data.get(
                        vol["secret"]["secretName"], set()):
                    problems.append(f"mount {m['mountPath']}: no key {m['subPath']}")
    return problems


def secret_paths(workload: Obj, container: Obj) -> list[str]:
    """Mount paths of the container's secret volumes."""
    secret_vols = {v["name"] for v in workload["spec"]["template"]["spec"].get("volumes", [])
                   if "secret" in v}
    return [m["mountPath"] for m in container.get("volumeMounts", [])
            if m["name"] in secret_vols]


def keys_from_secrets(objects: list[Obj]) -> list[str]:
    """API keys and link keys are files the processes read from Secret mounts."""
    problems = []
    for mod, flags in (("gateway.main", ("--api-key-file", "--link-secret-key",
                                         "--link-authorized-keys")),
                       ("engine_worker.main", ("--link-secret-key", "--link-gateway-key"))):
        w, c = the(objects, mod)
        mounts = secret_paths(w, c)
        for flag in flags:
            if flag not in c["command"]:
                problems.append(f"{mod} is not given {flag}")
                continue
            path = c["command"][c["command"].index(flag) + 1]
            if not any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts):
                problems.append(f"{mod} {flag} {path} is not on a Secret mount")
        if any(e["name"] in ("KESTREL_API_KEYS",) and "value" in e for e in c.get("env", [])):
            problems.append(f"{mod} has API keys in plain env")
    return problems


def link_port_policy(objects: list[Obj]) -> list[str]:
    """Some NetworkPolicy selects the gateway, and its every rule that opens the link port
    admits worker pods only."""
    gw, gc = the(objects, "gateway.main")
    ww, _ = the(objects, "engine_worker.main")
    engine = int(plain_env(gc)["KESTREL_ENGINE_ADDRESS"].rsplit(":", 1)[1])
    policies = [p for p in by_kind(objects, "NetworkPolicy")
                if selects(p["spec"]["podSelector"].get("matchLabels"), pod_labels(gw))
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return ["no NetworkPolicy restricts ingress to the gateway"]
    problems = []
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            ports = [p.get("port") for p in rule.get("ports", [])]
            if ports and engine not in ports and "engine" not in ports:
                continue  # this rule does not open the link port
            peers = rule.get("from")
            if not peers or not all(
                    set(p) == {"podSelector"} and selects(p["podSelector"].get("matchLabels"),
                                                          pod_labels(ww)) for p in peers):
                problems.append(f"{pol['metadata']['name']}: the link port is open to more "
                                "than the worker pods")
    return problems


def resource_requests(objects: list[Obj]) -> list[str]:
    return [f"{w['metadata']['name']}/{c['name']} has no cpu and memory requests"
            for w in workloads(objects) for c in containers(w)
            if not {"cpu", "memory"} <= set(c.get("resources", {}).get("requests", {}))]


def grace_outlasts_drain(objects: list[Obj]) -> list[str]:
    problems = []
    for mod, backstop in (("gateway.main", DRAIN_BACKSTOP_S), ("engine_worker.main", 0.0)):
        w, c = the(objects, mod)
        drain = check_command(c["command"], plain_env(c)).drain_timeout_s
        grace = w["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        if grace <= drain + backstop + 5:
            problems.append(f"{mod}: {grace} s grace cuts its {drain} s drain")
    return problems


ALL = (readiness_deadlock, statefulset_services, worker_probes, one_worker_per_gpu_host,
       secrets_exist, keys_from_secrets, link_port_policy, resource_requests, grace_outlasts_drain)
