"""deploy/: the Grafana dashboard loads, every metric its queries name is one a running server
exports, and the provisioning files, docker-compose.yml and prometheus.yml agree with each other
(datasource uid, dashboard folder, service names and ports)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.compose_files import project

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "kestrel-dashboard.json"
METRIC_NAME = re.compile(r"\bkestrel_[A-Za-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
            "summary": ("_count", "_sum")}


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:  # a collapsed row holds its panels inside it
        yield panel
        yield from panels(panel.get("panels", []))


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]


def test_the_dashboard_loads_and_has_its_panels() -> None:
    dash = load_dashboard()
    assert dash["uid"] and dash["title"]
    shown = [p for p in panels(dash["panels"]) if p["type"] != "row"]
    ids = [p["id"] for p in panels(dash["panels"])]
    assert len(ids) == len(set(ids))
    for p in shown:
        assert p["title"] and p["gridPos"] and p["targets"], p["title"]
        assert all(t["expr"].strip() and t["refId"] for t in p["targets"]), p["title"]
    queries = exprs(dash)
    for q in queries:  # percentiles come from the buckets' rates, aggregated keeping `le`
        if "histogram_quantile" in q:
            assert re.search(r"sum by \(le[,)].*rate\(kestrel_\w+_bucket\[", q), q
    joined = "\n".join(queries)
    for needed in ("histogram_quantile(0.99, sum by (le) (rate(kestrel_time_to_first_token",
                   "histogram_quantile(0.99, sum by (le) (rate(kestrel_inter_token_latency",
                   "rate(kestrel_generation_tokens_total", "kestrel_requests_waiting",
                   "kestrel_requests_in_flight", "kestrel_worker_kv_cache_usage_ratio",
                   "kestrel_prefix_cache_hit_tokens_total", 'status="429"', 'status=~"5.."'):
        assert needed in joined, needed


def test_every_metric_the_dashboard_names_is_exported(tiny_server: Any) -> None:
    gw, _ = tiny_server
    exported: set[str] = set()
    for family in text_string_to_metric_families(gw.metrics()):
        exported.add(family.name)
        exported.update(family.name + s for s in SUFFIXES.get(family.type, ()))
        exported.update(s.name for s in family.samples)
    named = {name for q in exprs(load_dashboard()) for name in METRIC_NAME.findall(q)}
    assert len(named) > 10
    assert named <= exported, sorted(named - exported)
    # The worker's figures are in the scrape with a worker attached, not only their names.
    assert any(n.startswith("kestrel_worker_") for n in exported)


def test_provisioning_compose_and_prometheus_agree() -> None:
    yaml = pytest.importorskip("yaml")  # PyYAML: installed with transformers (the worker extra)
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text(encoding="utf-8"))
    services = compose["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert (DEPLOY / mounts["./grafana/provisioning"]).name == "provisioning"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboard_target = mounts["./grafana/kestrel-dashboard.json"]

    [provider] = yaml.safe_load(
        next((GRAFANA / "provisioning" / "dashboards").glob("*.yml")).read_text())["providers"]
    assert provider["type"] == "file"
    assert str(Path(dashboard_target).parent) == provider["options"]["path"]

    [source] = yaml.safe_load(
        next((GRAFANA / "provisioning" / "datasources").glob("*.yml")).read_text())["datasources"]
    assert source["type"] == "prometheus"
    assert re.match(r"http://prometheus:9090/?$", source["url"]) and "prometheus" in services
    uids = {t["datasource"]["uid"] for p in panels(load_dashboard()["panels"])
            for t in p.get("targets", [])}
    assert uids == {source["uid"]}

    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text(encoding="utf-8"))
    [job] = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    [target] = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in services and services[host]["environment"]["PORT"] == port


def test_prometheus_scrapes_with_a_key_the_gateway_accepts(tmp_path: Path) -> None:
    """Issue 23: with API keys set, /metrics wants one. Prometheus reads its key from a secret
    compose gives it, and make-secrets.sh puts that same key among the gateway's API keys."""
    yaml = pytest.importorskip("yaml")
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text(encoding="utf-8"))
    [job] = prom["scrape_configs"]
    auth = job["authorization"]
    assert auth["type"] == "Bearer"
    secret = auth["credentials_file"].removeprefix("/run/secrets/")
    services = project()["services"]
    assert secret in services["prometheus"]["secrets"]
    subprocess.run(["bash", str(DEPLOY / "make-secrets.sh"), str(tmp_path / "s")], check=True,
                   capture_output=True, env={**os.environ, "PYTHON": sys.executable})
    key = (tmp_path / "s" / secret).read_text().strip()
    api_keys = (tmp_path / "s" / "api_keys").read_text().split()
    assert key and key in api_keys and len(api_keys) == 2  # the users' key and Prometheus'
