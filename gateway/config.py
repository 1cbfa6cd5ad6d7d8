"""The gateway's settings: flags and KESTREL_* variables (PORT for the port), checked once."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.settings import setting
from protocol.transport import DEFAULT_ENGINE_ADDRESS


@dataclass(frozen=True)
class GatewayConfig:
    host: str = setting("127.0.0.1", "HTTP listen address")
    port: int = setting(8000, "HTTP port")
    engine_address: str = setting(DEFAULT_ENGINE_ADDRESS, "ZeroMQ address workers connect to")
    max_outstanding: int = setting(0, "most requests running or waiting at the workers "
                                   "(0: the sum of the workers' announced max_num_seqs)")
    max_queue: int = setting(64, "most requests waiting in the gateway beyond that; then 429")
    max_prompt_chars: int = setting(4096, "longest prompt, in characters")
    max_tokens_cap: int = setting(1024, "largest max_tokens a request may ask for")
    default_timeout_s: float = setting(30.0, "deadline of a request, counted from its arrival")
    max_body_bytes: int = setting(1 << 20, "largest request body")
    api_keys: str = setting("", "comma-separated API keys; empty: no auth")
    api_key_file: str = setting("", "file with one API key per line")
    protect_metrics: bool = setting(False, "require an API key for /metrics too")
    rate_limit_rps: float = setting(0.0, "per-client requests per second (0: off)")
    rate_limit_burst: int = setting(10, "per-client burst size")
    heartbeat_timeout_s: float = setting(1.5, "a worker silent this long is lost")
    drain_timeout_s: float = setting(30.0, "on SIGTERM, how long in-flight requests may finish")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")
    otlp_endpoint: str = setting("", "OpenTelemetry OTLP/HTTP endpoint for traces, e.g. "
                                 "http://127.0.0.1:4318 (empty: tracing off; needs the otel extra)")

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, not {self.port}")
        if not self.engine_address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"engine_address must be a ZeroMQ address: {self.engine_address!r}")
        for name in ("max_prompt_chars", "max_tokens_cap", "max_body_bytes", "rate_limit_burst"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_outstanding < 0 or self.max_queue < 0:
            raise ValueError("max_outstanding and max_queue must be >= 0")
        if self.default_timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise ValueError("default_timeout_s and heartbeat_timeout_s must be positive")
        if self.rate_limit_rps < 0 or self.drain_timeout_s < 0:
            raise ValueError("rate_limit_rps and drain_timeout_s must be >= 0")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"unknown log_level {self.log_level!r}")

    def keys(self) -> frozenset[str]:
        """The configured API keys (setting and file). Read once at start by the app."""
        keys = {k.strip() for k in self.api_keys.split(",") if k.strip()}
        if self.api_key_file:
            with open(self.api_key_file, encoding="utf-8") as fh:
                keys |= {line.strip() for line in fh if line.strip() and not line.startswith("#")}
        return frozenset(keys)
