"""The gateway's settings: flags and KESTREL_* variables (PORT for the port), checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from common.settings import setting
from protocol.transport import DEFAULT_ENGINE_ADDRESS

# The choices of two flags, named here so that the settings import nothing of the gateway above
# them: gateway.engine.router implements the policies, gateway.output.reasoning the parsers.
ROUTING_POLICIES = ("cache_aware", "least_loaded")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = setting("127.0.0.1", "HTTP listen address")
    port: int = setting(8000, "HTTP port")
    engine_address: str = setting(DEFAULT_ENGINE_ADDRESS, "ZeroMQ address workers connect to")
    max_outstanding: int = setting(0, "most requests running or waiting at the workers "
                                   "(0: the sum of the workers' announced max_num_seqs)")
    max_queue: int = setting(64, "most requests waiting in the gateway beyond that; then 429")
    max_prompt_chars: int = setting(65536, "longest prompt, in characters (a chat: its "
                                    "messages' text); the context bounds its tokens anyway")
    max_tokens_cap: int = setting(1024, "largest max_tokens a request may ask for")
    default_timeout_s: float = setting(0.0, "deadline of a request that names no timeout, counted "
                                       "from its arrival (0: none, as vLLM and llama.cpp)")
    models_dir: str = setting("", "kestrel serve only: serve every model in this folder (GGUF "
                              "files; folders with a config.json), each loaded on demand by "
                              "its first request")
    models_max: int = setting(0, "with --models-dir: at most this many models loaded at once, "
                              "the least recently used idle one unloaded first (0: no bound)")
    sleep_idle_seconds: float = setting(0.0, "with --models-dir: unload a model nobody asked "
                                        "for in this many seconds (0: never)")
    max_timeout_s: float = setting(0.0, "longest timeout a request may name; a longer one is "
                                   "held to this (0: any)")
    max_body_bytes: int = setting(1 << 20, "largest request body")
    api_keys: str = setting("", "API keys, comma-separated (--api-key: one a flag, repeated); "
                            "empty: no auth", flags=("--api-key",), repeat="append")
    api_key_file: str = setting("", "file with one API key per line")
    admin_keys: str = setting("", "with API keys set: the keys that may load and unload models "
                              "by hand (/models/load, /models/unload; any other key gets 403), "
                              "comma-separated; each is an API key too")
    open_metrics: bool = setting(False, "with API keys set, still serve /metrics and /health "
                                 "without one (a scraper on a private network); /health/live "
                                 "and /health/ready never need a key")
    rate_limit_rps: float = setting(0.0, "per-client requests per second (0: off)")
    rate_limit_burst: int = setting(10, "per-client burst size")
    forwarded_allow_ips: str = setting(
        "", "comma-separated proxy addresses (or *) whose X-Forwarded-For names the client; "
        "empty: trust no proxy, the client is the peer address")
    max_connections: int = setting(1024, "most open HTTP connections; beyond it a new request "
                                   "gets 503 (uvicorn's limit_concurrency)")
    header_timeout_s: float = setting(10.0, "a connection whose request headers are not complete "
                                      "this long after its first byte (or its opening) is closed")
    body_timeout_s: float = setting(10.0, "a request body not received in full within this is "
                                    "answered 408")
    send_timeout_s: float = setting(10.0, "a response write that the client does not take in "
                                    "this long ends the request (and frees its place)")
    sse_keepalive_s: float = setting(10.0, "a stream with nothing to send this long gets an SSE "
                                     "comment, so proxies do not cut it while it waits")
    max_rendered_prompt_chars: int = setting(
        0, "longest prompt a chat template may render, in characters (0: 2 x max_prompt_chars "
        "+ 4096, room for the template's own scaffolding)")
    template_timeout_s: float = setting(2.0, "longest a chat template may take to render")
    reasoning_parser: str = setting("", "return a reasoning model's <think>...</think> apart "
                                    "from its answer, as reasoning_content and reasoning: "
                                    "deepseek_r1 (the template opens it) or qwen3 (the model "
                                    "does); empty: off")
    heartbeat_timeout_s: float = setting(1.5, "a worker silent this long is lost")
    link_secret_key: str = setting("", "the gateway's CURVE secret certificate (NAME.key_secret "
                                   "from kestrel-keygen); with --link-authorized-keys turns "
                                   "on authentication and encryption of the engine link")
    link_authorized_keys: str = setting("", "folder of the public certificates (.key) of the "
                                        "workers allowed to join")
    insecure_link: bool = setting(False, "allow a TCP engine link without CURVE keys: any "
                                  "process that reaches its port, on this host or not, can join "
                                  "as a worker, read prompts and write answers")
    routing: str = setting("cache_aware", "worker choice: cache_aware (load and prefix blocks "
                           "held) or least_loaded")
    drain_timeout_s: float = setting(30.0, "on SIGTERM, how long in-flight requests may finish")
    api_server_count: int = setting(1, "gateway processes accepting on this port (SO_REUSEPORT); "
                                    "process i binds its own engine link at engine_address's "
                                    "port + i (ipc: PATH.i), and every worker joins all of them; "
                                    "the rate limit is shared, worker capacity and max_queue split")
    api_server_index: int = setting(0, "this process's place among api_server_count (process 0 "
                                    "sets it for the ones it starts)")
    shared_state: str = setting("", "file the API server processes share the rate limit through "
                                "(process 0 makes it)")
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
        for name in ("max_connections", "header_timeout_s", "body_timeout_s", "send_timeout_s",
                     "sse_keepalive_s", "template_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} "
                             "(or empty)")
        if self.max_rendered_prompt_chars < 0:
            raise ValueError("max_rendered_prompt_chars must be >= 0")
        if not 0 <= self.api_server_index < self.api_server_count:
            raise ValueError("api_server_count must be >= 1 and api_server_index below it")
        if self.max_outstanding < 0 or self.max_queue < 0:
            raise ValueError("max_outstanding and max_queue must be >= 0")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be positive")
        if self.admin_keys and not (self.api_keys or self.api_key_file):
            raise ValueError("admin_keys needs API keys (without them anyone may load models)")
        if self.models_max < 0 or self.sleep_idle_seconds < 0:
            raise ValueError("models_max and sleep_idle_seconds must be >= 0 (0: none)")
        if self.models_dir and not Path(self.models_dir).is_dir():
            raise ValueError(f"models_dir: no folder {self.models_dir!r}")
        if self.default_timeout_s < 0 or self.max_timeout_s < 0:
            raise ValueError("default_timeout_s and max_timeout_s must be >= 0 (0: none)")
        if self.max_timeout_s and self.default_timeout_s > self.max_timeout_s:
            raise ValueError("default_timeout_s must not exceed max_timeout_s")
        if self.rate_limit_rps < 0 or self.drain_timeout_s < 0:
            raise ValueError("rate_limit_rps and drain_timeout_s must be >= 0")
        if bool(self.link_secret_key) != bool(self.link_authorized_keys):
            raise ValueError("link_secret_key and link_authorized_keys go together")
        if self.link_secret_key and not os.path.isfile(self.link_secret_key):
            raise ValueError(f"link_secret_key {self.link_secret_key!r} is not a file")
        if self.link_authorized_keys and not os.path.isdir(self.link_authorized_keys):
            raise ValueError(f"link_authorized_keys {self.link_authorized_keys!r} is not a folder")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"unknown log_level {self.log_level!r}")

    def link_problem(self) -> str | None:
        """Why the engine link must not start as set (None: it may). Checked by the processes
        that bind it, not here: a config is also built where nothing binds."""
        if self.engine_address.startswith("tcp://") and not self.link_secret_key \
                and not self.insecure_link:
            return (f"engine_address {self.engine_address} is a TCP link without CURVE keys: any "
                    "process that reaches it can join as a worker. Give --link-secret-key and "
                    "--link-authorized-keys (kestrel-keygen makes them), an ipc:// address, or "
                    "--insecure-link to accept the risk")
        return None

    @property
    def rendered_prompt_limit(self) -> int:
        return self.max_rendered_prompt_chars or 2 * self.max_prompt_chars + 4096

    def keys(self) -> frozenset[str]:
        """The configured API keys (setting and file). Read once at start by the app."""
        keys = {k.strip() for k in self.api_keys.split(",") if k.strip()}
        if self.api_key_file:
            with open(self.api_key_file, encoding="utf-8") as fh:
                keys |= {line.strip() for line in fh if line.strip() and not line.startswith("#")}
        return frozenset(keys | self.admin_key_set())

    def admin_key_set(self) -> frozenset[str]:
        """The keys of the operator routes (admin_keys)."""
        return frozenset(k.strip() for k in self.admin_keys.split(",") if k.strip())
