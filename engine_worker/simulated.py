"""`kestrel-sim-worker`: a worker that speaks the real protocol but computes nothing (no torch).

    tokenizer folder ──tokenizer_info──▶ Hello ──real WorkerLink (CURVE, limits)──▶ gateway
    Generate ──WorkerLoop (the real one)──▶ SimEngine: sleeps per step by a cost model

For routing and scaling tests with 8-16 workers on one small machine: each process costs a few
tens of MB and almost no CPU. Tokens are plain ids from the tokenizer's vocabulary; the prefix
cache and the load the gateway sees behave like a real worker's.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.jsonlog import setup_logging
from common.settings import parse_settings, setting
from engine_worker.main import serve
from engine_worker.sim_engine import CostModel, SimEngine
from protocol import messages as m
from protocol.codec import tokenizer_digest
from protocol.transport import DEFAULT_ENGINE_ADDRESS, new_worker_id

log = logging.getLogger("kestrel.worker.sim")


@dataclass(frozen=True)
class SimWorkerConfig:
    gateway_address: str = setting(DEFAULT_ENGINE_ADDRESS, "ZeroMQ address of the gateway (one "
                                   "per API server process, comma-separated)")
    model: str = setting("", "a folder holding the tokenizer to announce (tokenizer.json ...)")
    model_id: str = setting("", "name the model is served as (default: the folder's name)")
    max_num_seqs: int = setting(16, "most sequences in the running batch")
    max_model_len: int = setting(2048, "longest prompt + output in tokens")
    kv_capacity_tokens: int = setting(65536, "prefix cache size, in tokens")
    block_size: int = setting(16, "tokens per KV block")
    step_base_ms: float = setting(20.0, "cost model: milliseconds per engine step")
    prefill_token_ms: float = setting(0.1, "cost model: milliseconds per uncached prompt token")
    decode_seq_ms: float = setting(1.0, "cost model: milliseconds per decoding sequence")
    link_secret_key: str = setting("", "this worker's CURVE secret certificate")
    link_gateway_key: str = setting("", "the gateway's public certificate")
    heartbeat_s: float = setting(0.25, "seconds between heartbeats to the gateway")
    drain_timeout_s: float = setting(30.0, "on SIGTERM, how long in-flight requests may finish")
    otlp_endpoint: str = setting("", "OpenTelemetry OTLP/HTTP endpoint for traces (empty: off)")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")

    def __post_init__(self) -> None:
        if not (Path(self.model) / "tokenizer.json").is_file():
            raise ValueError(f"model {self.model!r} must be a folder with a tokenizer.json")
        for name in ("max_num_seqs", "max_model_len", "kv_capacity_tokens", "block_size",
                     "heartbeat_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if min(self.step_base_ms, self.prefill_token_ms, self.decode_seq_ms) < 0:
            raise ValueError("cost model figures must be >= 0")
        if bool(self.link_secret_key) != bool(self.link_gateway_key):
            raise ValueError("link_secret_key and link_gateway_key go together")


def sim_hello(cfg: SimWorkerConfig) -> m.Hello:
    from engine_worker.model.tokenizer import tokenizer_info  # plain json reads, no torch

    info = tokenizer_info(Path(cfg.model))
    return m.Hello(m.PROTOCOL_VERSION, new_worker_id(), cfg.model_id or Path(cfg.model).name,
                   cfg.max_model_len, cfg.kv_capacity_tokens, cfg.max_num_seqs, info,
                   device="simulated", block_size=cfg.block_size,
                   tokenizer_digest=tokenizer_digest(info))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_settings(SimWorkerConfig, argv, prog="kestrel-sim-worker",
                         description="Kestrel simulated-compute worker (no torch).")
    setup_logging(cfg.log_level)
    stop = threading.Event()

    def on_term(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    cost = CostModel(cfg.step_base_ms / 1000, cfg.prefill_token_ms / 1000,
                     cfg.decode_seq_ms / 1000)
    engine = SimEngine(cfg.max_num_seqs, cfg.kv_capacity_tokens, cfg.block_size,
                       cfg.max_model_len, cost)
    hello = sim_hello(cfg)
    log.info("model loaded", extra={"fields": {"model": hello.model_id, "simulated": True}})
    return serve(cfg, engine, hello, stop)


if __name__ == "__main__":
    raise SystemExit(main())
