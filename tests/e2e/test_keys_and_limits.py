"""Issue 54: one rule for keys and limits. Every route behind the API key is behind the rate
limit too, and only the liveness probes listed in gateway.api.app.PROBES are behind neither;
/openapi.json, which names the served models, is behind the key.

At 1 request per 100 s with a burst of 2, /api/tags, /api/ps, /api/show, /v1/models, /health and
/metrics answered 10 of 10, and /openapi.json answered without a key while /v1/models was 401.
The routes are read from the app itself, so a route added later is held to the rule too.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from starlette.routing import Route

from gateway.api.app import PROBES, create_app
from gateway.config import GatewayConfig
from tests.procs import GatewayProc


def routes() -> list[tuple[str, str]]:
    app = create_app(GatewayConfig())
    return sorted((r.path, method) for r in app.routes if isinstance(r, Route)
                  for method in sorted(r.methods or ()) if method != "HEAD")


ROUTES = routes()
KEYS = [f"key{i}" for i in range(len(ROUTES))]  # one client per route: its own bucket
SPARE = "spare"


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProc]:
    with GatewayProc("--api-keys", ",".join([*KEYS, SPARE]), "--rate-limit-rps", "0.01",
                     "--rate-limit-burst", "2") as gw:
        gw.wait_live()
        yield gw


def call(gw: GatewayProc, path: str, method: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, gw.base_url + path, headers=headers, content=b"{}",
                         timeout=30).status_code


def test_every_route_but_the_probes_is_behind_the_key_and_the_limit(gateway: GatewayProc) -> None:
    assert {path for path, _ in ROUTES} >= set(PROBES)
    unkeyed, unlimited = [], []
    for (path, method), key in zip(ROUTES, KEYS, strict=True):
        if path in PROBES:
            statuses = [call(gateway, path, method) for _ in range(4)]
            assert 401 not in statuses and 429 not in statuses, (path, statuses)
            continue
        if call(gateway, path, method) != 401:
            unkeyed.append(path)
        statuses = [call(gateway, path, method, key) for _ in range(3)]
        assert 401 not in statuses, (path, statuses)
        if statuses[-1] != 429:
            unlimited.append(path)
    assert (unkeyed, unlimited) == ([], [])


def test_openapi_json_is_behind_the_key(gateway: GatewayProc) -> None:
    assert call(gateway, "/openapi.json", "GET") == 401
    resp = httpx.get(gateway.base_url + "/openapi.json", timeout=30,
                     headers={"Authorization": f"Bearer {SPARE}"})
    assert resp.status_code == 200 and resp.json()["openapi"]
