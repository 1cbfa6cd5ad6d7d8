"""`kestrel-gateway`: the HTTP front (no torch). Workers join it over ZeroMQ.

On SIGTERM/SIGINT it stops admitting (ready turns 503, new requests get 503), lets in-flight
requests finish for up to drain_timeout_s, then exits 0.
"""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from protocol.jsonlog import setup_logging
from protocol.settings import parse_settings

log = logging.getLogger("kestrel.gateway")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app to refuse new work as soon as a signal arrives."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._app.state.gateway.draining = True
        log.info("signal %d: draining in-flight requests, then exiting", sig)
        super().handle_exit(sig, frame)


def parse(argv: list[str] | None = None) -> GatewayConfig:
    return parse_settings(GatewayConfig, argv, prog="kestrel-gateway",
                          description="Kestrel gateway: OpenAI-compatible HTTP API over ZeroMQ "
                                      "engine workers.", extra_env={"port": "PORT"})


def run(cfg: GatewayConfig) -> None:
    setup_logging(cfg.log_level)
    app = create_app(cfg)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None,
                            access_log=False, timeout_graceful_shutdown=int(cfg.drain_timeout_s),
                            lifespan="on")
    DrainingServer(config, app).run()


def main(argv: list[str] | None = None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
