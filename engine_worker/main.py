"""`kestrel-worker`: load a model, join a gateway, serve until told to stop.

The main thread owns the model and runs the engine loop:

    drain inbound (Generate/Cancel/Reset; a request with a grammar first waits for its
    matchers, built on another thread: grammar_builds) -> abort expired -> engine.step() -> push
    the step's token frames as one StepOutputs message

and never waits on the network: the link's I/O thread owns the socket. Hello is sent only after
the model is loaded, so the gateway's readiness follows the model's.
"""

from __future__ import annotations

import gc
import logging
import queue
import signal
import struct
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.jsonlog import setup_logging
from common.settings import parse_settings
from engine_worker.config import WorkerConfig
from engine_worker.engine_surface import EngineSurface
from engine_worker.grammar_builds import GrammarBuilds
from engine_worker.link_surface import LinkSurface
from engine_worker.memory_budget import trim_heap
from engine_worker.naming import served_names
from protocol import messages as m
from protocol.codec import hello_over_limit, tokenizer_digest
from protocol.transport import is_loopback, load_public_key, load_secret_key, new_worker_id

log = logging.getLogger("kestrel.worker")


class WorkerLoop:
    """Glue between the link (network) and the engine (tensors)."""

    def __init__(self, cfg: WorkerConfig, engine: EngineSurface, link: LinkSurface,
                 stop: threading.Event) -> None:
        self.cfg = cfg
        self.engine = engine
        self.link = link
        self.out = link.open_outbound()
        self.stop = stop  # set by the signal handler: drain, then return
        self.drain_started: float | None = None
        # Tokens sampled for a request after its Cancel reached the I/O thread; logged per request
        # so tests can check that a cancel is honoured within one step.
        self.after_cancel: dict[str, int] = defaultdict(int)
        self.finish: dict[str, list[str]] = defaultdict(list)
        from engine_worker.tracing import WorkerTracer

        # One span per request when an OTLP endpoint is set (None: off, nothing imported).
        self.tracer = WorkerTracer.create(cfg.otlp_endpoint, link.worker_id)
        compiler = engine.grammars  # None: no structured output here
        self.builds = None if compiler is None else GrammarBuilds(compiler, link.quiet)

    def run(self) -> int:
        self.was_busy = False
        while True:
            if self.link.rejected is not None:
                return 3
            self._drain_inbound(block=not self.engine.has_work)
            for gen, built in self.builds.ready() if self.builds else []:
                self._add(gen, built)
            for rid in self.engine.expired(time.time()):
                self._send_all(self.engine.abort(rid, "timeout"))
            # The engine stamps a request's first frame with its time since first scheduled.
            self._send_all(self.engine.step())
            for error in self.engine.pop_errors():  # e.g. a model that computed NaN
                self.out.send(error)
            busy = self.engine.has_work
            if self.was_busy and not busy:  # just went idle: nothing may be left held
                self.engine.check_idle()
                trim_heap()  # what the steps' activations took (a prefill chunk's: tens of MiB)
            self.was_busy = busy
            self.link.stats = self.engine.stats()
            if self.stop.is_set():
                if self.drain_started is None:
                    self.drain_started = time.monotonic()
                    self.link.draining = True
                    log.info("draining: finishing %d requests", len(self.engine.requests))
                overdue = time.monotonic() - self.drain_started > self.cfg.drain_timeout_s
                if overdue:
                    for rid in list(self.engine.requests):
                        self._send_all(self.engine.abort(rid, "abort"))
                    for rid in list(self.builds.pending if self.builds else []):
                        self._add(self.builds.pending[rid][0], ValueError("worker is "
                                                                          "shutting down"))
                        self.builds.drop(rid)
                if not self.engine.has_work and not self.builds:
                    return 0

    def _drain_inbound(self, block: bool) -> None:
        """Handle every queued message; when idle, first wait up to 50 ms for one."""
        try:
            msg = self.link.inbound.get(timeout=0.05) if block else self.link.inbound.get_nowait()
            while True:
                self._handle(msg)
                msg = self.link.inbound.get_nowait()
        except queue.Empty:
            return

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, m.Generate):
            if self.stop.is_set():
                self.out.send(m.RequestError(msg.request_id, "worker is shutting down",
                                             "unavailable"))
                return
            log.info("request received", extra={"fields": {
                "event": "request_start", "request_id": msg.request_id,
                "prompt_tokens": len(msg.prompt_token_ids)}})
            if self.tracer is not None:
                self.tracer.received(msg)
            if msg.grammar is not None and self.builds is not None:
                self.builds.start(msg)  # joins the engine when its matchers are built
                return
            self._add(msg, None)
        elif isinstance(msg, m.Cancel) and msg.index is not None:
            self._send_all(self.engine.abort_choice(msg.request_id, msg.index))
        elif isinstance(msg, m.Cancel):
            if self.builds is not None and self.builds.drop(msg.request_id):
                self.link.forget(msg.request_id)  # ended before the engine saw it: no frame
            self._send_all(self.engine.abort(msg.request_id, "abort"))
            # The request has ended (its end, if it had one here, was logged by the line above
            # and took the arrival time with it): nothing else will pop it now.
            self.link.cancel_arrivals.pop(msg.request_id, None)
        elif isinstance(msg, m.Reset):  # the requests of the gateway that sent it
            building = list(self.builds.pending) if self.builds else []
            for rid in self.link.reset_scope(msg, list(self.engine.requests) + building):
                if self.builds and self.builds.drop(rid):
                    self.link.forget(rid)
                else:
                    self._send_all(self.engine.abort(rid, "abort"))

    def _add(self, msg: m.Generate, built: Any) -> None:
        """Into the engine (with its grammar's matchers, built), or a RequestError."""
        try:
            if isinstance(built, ValueError):  # GrammarError included
                raise built
            if isinstance(built, BaseException):  # the library's own failure: summarised
                raise ValueError(f"the grammar did not build: {type(built).__name__}")
            if built is None:
                self.engine.add(msg)
            else:
                self.engine.add(msg, built)
        except ValueError as exc:
            if self.tracer is not None:
                self.tracer.refused(msg.request_id, str(exc))
            self.out.send(m.RequestError(msg.request_id, str(exc), "invalid_request"))

    def _send_all(self, outputs: list[m.TokenOutput]) -> None:
        """One StepOutputs message for all of a step's (or an abort's) token frames."""
        if not outputs:
            return
        self.out.send(m.StepOutputs(outputs))
        ended: dict[str, m.TokenOutput] = {}
        for out in outputs:
            rid = out.request_id
            if out.token_ids and rid in self.link.cancel_arrivals:
                self.after_cancel[rid] += len(out.token_ids)
            if self.tracer is not None:
                self.tracer.output(out)
            if out.finish_reason is not None:
                self.finish[rid].append(out.finish_reason)
                if rid not in self.engine.requests:
                    ended[rid] = out
        for rid, out in ended.items():
            self._log_request_end(rid, out)

    def _log_request_end(self, rid: str, out: m.TokenOutput) -> None:
        fields = {
            "event": "request_end",
            "request_id": rid,
            "finish_reasons": self.finish.pop(rid, []),
            "prompt_tokens": out.prompt_tokens,
            "cached_tokens": out.cached_tokens,
            "tokens_after_cancel": self.after_cancel.pop(rid, 0),
        }
        if self.tracer is not None:
            self.tracer.finished(rid, out, fields["finish_reasons"])
        arrival = self.link.cancel_arrivals.pop(rid, None)
        if arrival is not None:  # monotonic -> wall clock, for comparing with the client's
            fields["cancel_received_ts"] = time.time() - (time.monotonic() - arrival)
        log.info("request ended", extra={"fields": fields})


def release_free_memory() -> None:
    """After start-up: collect what start-up left unreachable, then trim the heap."""
    gc.collect()
    trim_heap()


def build_hello(cfg: WorkerConfig, runner: Any, checkpoint: Path,
                step_costs: m.StepCosts | None = None,
                info: m.TokenizerInfo | None = None) -> m.Hello:
    """The worker's Hello; `info`: the checkpoint's tokenizer_info when read already (its
    tokenizer.json is 20 MiB as a str for a 151,936-token vocabulary: read once, held once)."""
    from engine_worker.model.tokenizer import tokenizer_info

    names = served_names(cfg.model, checkpoint, cfg.served_names())
    info = info or tokenizer_info(checkpoint)
    if cfg.chat_template:  # the operator's template over the model's
        info = replace(info, chat_template=Path(cfg.chat_template).read_text(encoding="utf-8"))
    return m.Hello(
        protocol_version=m.PROTOCOL_VERSION,
        worker_id=new_worker_id(),
        model_id=names[0],
        max_model_len=runner.max_model_len,
        kv_capacity_tokens=runner.num_blocks * runner.block_size,
        max_num_seqs=cfg.max_num_seqs,
        tokenizer=info,
        device=str(runner.device),
        dtype=runner.dtype_name,
        quantization=runner.quant.mode,
        weight_bytes=runner.weight_bytes,
        aliases=list(names[1:]),
        block_size=runner.block_size,
        tokenizer_digest=tokenizer_digest(info),
        step_costs=step_costs,
        embedding_size=runner.config.hidden_size,
        matmul_plan=runner.plan.describe(),
        kv_cache_dtype=runner.kv_dtype_name,
        decode_read_bytes=runner.decode_read_bytes,
        kv_bytes_per_token=runner.kv_bytes_per_token,
    )


def open_link(cfg: WorkerConfig, hello: m.Hello) -> LinkSurface:
    """The worker's link, with CURVE keys when configured (warned about off loopback); one per
    address when the gateway runs several API server processes (comma-separated addresses),
    each announcing its share of max_num_seqs."""
    from engine_worker.link import WorkerLink
    from engine_worker.link_set import LinkSet

    keys = load_secret_key(cfg.link_secret_key) if cfg.link_secret_key else None
    gateway_key = load_public_key(cfg.link_gateway_key) if cfg.link_gateway_key else None
    addresses = gateway_addresses(cfg.gateway_address)
    for address in addresses:
        if keys is None and not is_loopback(address):
            log.warning("joining %s without CURVE keys: the link is neither authenticated nor "
                        "encrypted (pass --link-secret-key and --link-gateway-key)", address)
    if len(addresses) == 1:
        return WorkerLink(addresses[0], hello, cfg.heartbeat_s, keys, gateway_key)
    share = replace(hello, max_num_seqs=max(1, hello.max_num_seqs // len(addresses)))
    return LinkSet([WorkerLink(a, share, cfg.heartbeat_s, keys, gateway_key) for a in addresses])


def gateway_addresses(setting: str) -> list[str]:
    return [a.strip() for a in setting.split(",") if a.strip()]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_settings(WorkerConfig, argv, prog="kestrel-worker",
                         description="Kestrel engine worker: owns a model, joins a gateway.")
    setup_logging(cfg.log_level)
    from engine_worker.engine import Engine
    from engine_worker.model_runner import ModelRunner
    from engine_worker.probe_record import ProbeRecord
    from engine_worker.runner_config import RunnerConfig

    stop = threading.Event()

    def on_term(signum: int, _frame: Any) -> None:
        log.info("signal %d: draining then exiting", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    started = time.monotonic()
    from engine_worker.model.gguf_native import ModelRefused

    try:
        runner = ModelRunner(RunnerConfig.from_worker(cfg))
    except ModelRefused as exc:  # a file we will not serve: one line, no trace, exit 2
        log.error("model refused: %s", exc)
        return 2
    except (ValueError, KeyError, IndexError, OverflowError, struct.error,
            UnicodeDecodeError) as exc:
        if not str(cfg.model).lower().endswith(".gguf"):
            raise  # our own code's error on a folder we converted: the trace is the report
        # A GGUF file that does not parse is the file's fault: one line (the parser's words,
        # which name the field or tensor where they can), the trace only at debug level.
        log.debug("the GGUF file did not parse", exc_info=True)
        log.error("model refused: the GGUF file did not parse: %s: %s", type(exc).__name__,
                  " ".join(str(exc).split())[:500])
        return 2
    log.info("%s", runner.plan.describe())  # "matmul plan: ...", once
    checkpoint = runner.runner_config.model_path
    from engine_worker.grammar import GrammarCompiler
    from engine_worker.model.tokenizer import tokenizer_info
    from engine_worker.speculative.build import build_spec_decoder

    info = tokenizer_info(checkpoint)  # its tokenizer.json serves the Hello and the grammars
    grammars = GrammarCompiler(info.tokenizer_json, runner.config.vocab_size,
                               list(runner.config.eos_token_ids))
    engine = Engine(runner, max_num_seqs=cfg.max_num_seqs,
                    max_num_batched_tokens=cfg.max_num_batched_tokens,
                    enable_prefix_caching=cfg.prefix_caching,
                    spec=build_spec_decoder(cfg, runner), grammars=grammars,
                    prefill_share=cfg.step_prefill_share, step_floor_s=cfg.step_floor_ms / 1e3,
                    pooling=cfg.pooling)
    # The first requests are sized and admitted by this host's measurement: an earlier start's
    # probe of this model here, or one now (engine_worker/probe_record.py).
    record = ProbeRecord.for_runner(Path(cfg.cache_dir), runner, {
        "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "threads_setting": cfg.threads})
    if not record.seed(engine.costs):
        engine.probe()
        record.save(engine.costs)
    hello = build_hello(cfg, runner, checkpoint, engine.costs.report(), info)
    too_big = hello_over_limit(hello)
    if too_big is not None:  # it would be dropped unread, and we would wait for a Welcome
        log.error("model refused: %s", too_big)
        return 2
    log.info("model loaded", extra={"fields": {
        "model": hello.model_id, "seconds": round(time.monotonic() - started, 2),
        "kv_capacity_tokens": hello.kv_capacity_tokens, "max_model_len": hello.max_model_len,
        "worker_id": hello.worker_id}})
    release_free_memory()
    # What start-up built lives until exit: out of the collector's sight, a full collection (and
    # the one at exit, 0.5-1 s with torch and a tokenizer loaded) no longer walks it.
    gc.freeze()
    return serve(cfg, engine, hello, stop)


def serve(cfg: Any, engine: Any, hello: m.Hello, stop: threading.Event) -> int:
    """Join the gateway and run the engine loop until it returns; the worker's exit status.
    `cfg` and `engine` are the real or the simulated worker's (same link fields, same engine
    interface)."""
    link = open_link(cfg, hello)
    link.start()
    loop = WorkerLoop(cfg, engine, link, stop)
    try:
        code = loop.run()
    except Exception as exc:
        log.exception("engine loop failed")
        link.stop(dying_reason=f"engine error: {type(exc).__name__}: {exc}")
        return 1
    link.stop(dying_reason="shutdown" if code == 0 else f"refused: {link.rejected}")
    if loop.tracer is not None:
        loop.tracer.shutdown()  # flush the last spans
    return code


if __name__ == "__main__":
    raise SystemExit(main())
