"""`kestrel-gateway`: the HTTP front (no torch). Workers join it over ZeroMQ.

On SIGTERM/SIGINT it stops admitting (ready turns 503, new and queued requests get 503, the port
stays open), lets in-flight requests finish for up to drain_timeout_s, ends those still running
with a 503 in their own shape (GatewayState.begin_drain), then closes the port and exits 0.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import time
from typing import Any

import uvicorn

from common.jsonlog import setup_logging
from common.settings import parse_settings
from gateway.admission.shared_limits import shared_state_problem
from gateway.api.app import create_app
from gateway.api_servers import Children, all_link_addresses, listen_socket, own_share
from gateway.config import GatewayConfig
from gateway.engine.on_demand import Spawner
from gateway.http.http_protocol import guarded_h11

log = logging.getLogger("kestrel.gateway")
DRAIN_BACKSTOP_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, kept listening through the drain.

    On SIGTERM/SIGINT the app refuses new work at once (503, /health/ready 503), but the port
    stays open, so a load balancer reads "draining" and a client gets a 503 it can act on, not a
    refused connection. When nothing is in flight any more, or drain_timeout_s has passed (the
    app then ends what still runs with a 503 in its own shape), uvicorn's own shutdown runs:
    listener closed, idle keep-alive connections asked to close, the lifespan's exit.
    """

    def __init__(self, config: uvicorn.Config, app: Any, drain_timeout_s: float,
                 children: Children | None = None) -> None:
        super().__init__(config)
        self._app = app
        self._children = children  # the other API server processes, when this is process 0
        self._drain_timeout_s = drain_timeout_s
        self._draining_since: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._children is not None:
            self._children.signal(sig)  # each drains as this one does
        self._app.state.gateway.begin_drain()
        # Not super().handle_exit: it records the signal, and after the shutdown uvicorn raises
        # it again with the default handler, so a clean drain would end with status -15, not 0.
        if self._draining_since is not None:
            if sig == signal.SIGINT:  # a second Ctrl-C: stop waiting for the requests in flight
                self.should_exit = self.force_exit = True
            return
        log.info("signal %d: draining in-flight requests, then exiting", sig)
        self._draining_since = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if self._draining_since is not None and not self.should_exit:
            waited = time.monotonic() - self._draining_since
            # + a moment past the timeout: the app's own 503s to what still ran go out first
            if self._app.state.gateway.idle or waited > self._drain_timeout_s + 0.5:
                self.should_exit = True
        return await super().on_tick(counter)


def parse(argv: list[str] | None = None) -> GatewayConfig:
    return parse_settings(GatewayConfig, argv, prog="kestrel-gateway",
                          description="Kestrel gateway: OpenAI-compatible HTTP API over ZeroMQ "
                                      "engine workers.", extra_env={"port": "PORT"})


def run(cfg: GatewayConfig, spawner: Spawner | None = None) -> None:
    """Serve until SIGTERM; `spawner`: the launcher's worker processes for --models-dir."""
    setup_logging(cfg.log_level)
    children = None
    if cfg.api_server_count > 1 and cfg.api_server_index == 0:
        children = Children(cfg)  # processes 1..K-1, sharing the rate limit through a file
        cfg = dataclasses.replace(cfg, shared_state=children.shared_state)
        children.start()
        log.info("%d API server processes on port %d; workers join %s", cfg.api_server_count,
                 cfg.port, ",".join(all_link_addresses(cfg)))
    cfg = own_share(cfg)
    app = create_app(cfg, spawner)
    # The app ends its own requests at drain_timeout_s (cleanly: an error response or event);
    # uvicorn's own limit, which cancels handlers mid-write, is only a backstop. A float on
    # purpose: uvicorn hands it to asyncio.wait_for, and int() would turn 0.5 s into 0.
    drain: Any = cfg.drain_timeout_s + DRAIN_BACKSTOP_S
    # uvicorn would trust X-Forwarded-For from loopback by default: then anyone on this host
    # (or behind a local proxy that passes the header through) picks the address the rate limit
    # sees. Only the proxies named in the setting are trusted.
    trusted = cfg.forwarded_allow_ips.strip()
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None,
                            access_log=False, timeout_graceful_shutdown=drain, lifespan="on",
                            proxy_headers=bool(trusted), forwarded_allow_ips=trusted or None,
                            http=guarded_h11(cfg.header_timeout_s, cfg.send_timeout_s),
                            limit_concurrency=cfg.max_connections)
    server = DrainingServer(config, app, cfg.drain_timeout_s, children)
    if cfg.api_server_count == 1:
        server.run()
        return
    try:  # the port is shared: each process accepts on its own SO_REUSEPORT socket
        server.run(sockets=[listen_socket(cfg.host, cfg.port)])
    finally:
        if children is not None:
            children.signal(signal.SIGTERM)
            children.wait(cfg.drain_timeout_s + DRAIN_BACKSTOP_S + 5)


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    problem = cfg.link_problem() or (shared_state_problem(cfg.shared_state)
                                     if cfg.shared_state else None)
    if cfg.models_dir:  # it takes the launcher, which starts the workers
        problem = "--models-dir needs `kestrel serve`, which starts the models' workers"

    if problem is not None:
        print(f"kestrel-gateway: error: {problem}", file=sys.stderr)
        return 2
    run(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
