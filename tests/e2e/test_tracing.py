"""Tracing end to end: real gateway and worker processes, each with its real OTLP/HTTP exporter
pointed at an in-memory collector in this test (a loopback HTTP server that decodes the OTLP
protobuf requests and keeps the spans in a list). Each request must give exactly one gateway
span and one worker span, in the same trace, the worker's a child of the gateway's, with the
usage attributes equal to the response's usage."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.procs import GatewayProc, WorkerProc, free_port

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)


class Collector:
    """An OTLP/HTTP traces receiver keeping (service name, span) pairs in memory."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                with collector.lock:
                    for rs in req.resource_spans:
                        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            collector.spans += [(attrs.get("service.name", ""), s)
                                                for s in ss.spans]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, service: str) -> list[Any]:
        with self.lock:
            return [s for name, s in self.spans if name == service]


def _attrs(span: Any) -> dict[str, Any]:
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = ([x.string_value for x in v.array_value.values] if kind == "array_value"
                      else getattr(v, kind))
    return out


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path) -> Iterator[tuple[GatewayProc, Collector]]:
    collector = Collector()
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s instead of 5 s
    with GatewayProc("--otlp-endpoint", collector.url, env=env) as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address, "--otlp-endpoint", collector.url,
                       env=env):
        gw.wait_ready()
        yield gw, collector
    collector.server.shutdown()


def test_one_gateway_and_one_worker_span_per_request_in_one_trace(traced) -> None:  # noqa: ANN001
    gw, collector = traced
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)
    usages = {}
    for i in range(3):
        out = client.chat.completions.create(
            model="tiny-llama-seed0", messages=[{"role": "user", "content": f"hello {i}"}],
            max_tokens=5 + i, temperature=0, stream=i == 2,
            **({"stream_options": {"include_usage": True}} if i == 2 else {}))
        usage = list(out)[-1].usage if i == 2 else out.usage
        usages[i] = (usage.prompt_tokens, usage.completion_tokens)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (len(collector.of("kestrel-gateway")) < 3
                                           or len(collector.of("kestrel-worker")) < 3):
        time.sleep(0.1)
    gateway, worker = collector.of("kestrel-gateway"), collector.of("kestrel-worker")
    assert len(gateway) == 3 and len(worker) == 3
    by_trace = {s.trace_id: s for s in gateway}
    assert len(by_trace) == 3  # one trace per request
    seen = set()
    for w in worker:
        g = by_trace[w.trace_id]  # same trace as exactly one gateway span
        assert w.parent_span_id == g.span_id  # a child of the gateway's server span
        ga, wa = _attrs(g), _attrs(w)
        assert ga["gen_ai.operation.name"] == "chat"
        assert ga["gen_ai.request.model"] == "tiny-llama-seed0"
        assert g.kind == 2  # SPAN_KIND_SERVER
        usage = (ga["gen_ai.usage.input_tokens"], ga["gen_ai.usage.output_tokens"])
        assert usage in usages.values()
        assert (wa["gen_ai.usage.input_tokens"], wa["gen_ai.usage.output_tokens"]) == usage
        assert [e.name for e in w.events] == ["queued", "first_token", "finished"]
        # The worker's span starts inside the gateway's (one host, one clock). Its end may
        # fall just after the gateway's: the worker closes it after sending the last frame.
        assert g.start_time_unix_nano <= w.start_time_unix_nano < g.end_time_unix_nano
        seen.add(usage)
    assert seen == set(usages.values())
