"""OpenTelemetry plumbing both processes share: an OTLP tracer provider and W3C trace context.

    gateway span ──traceparent()──▶ "00-<trace>-<span>-01" in Generate.traceparent ──ZeroMQ──▶
    worker ──parent_context()──▶ its span is a child of the gateway's, in the same trace

Tracing is optional (the `otel` extra). Nothing here imports opentelemetry at module level: the
callers build a provider only when an OTLP endpoint is configured, so with tracing off the
packages are neither needed nor imported. Spans go out in batches over OTLP/HTTP (protobuf) from
a background thread; `shutdown()` flushes what is left when the process stops.
"""

from __future__ import annotations

from typing import Any

TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base URL (http://host:4318) or a full traces URL -> the traces URL."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def tracer_provider(service_name: str, endpoint: str, attributes: dict[str, Any] | None = None
                    ) -> Any:
    """A TracerProvider exporting to `endpoint` in batches; raises ImportError without the
    `otel` extra. Not installed as the global provider: each process keeps its own."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": service_name, **(attributes or {})})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    return provider


def traceparent(span: Any) -> str:
    """The W3C traceparent header value that makes a remote span a child of `span`."""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return carrier.get("traceparent", "")


def parent_context(traceparent_value: str | None) -> Any:
    """The context a traceparent value names (None or a malformed one: a new root trace)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not traceparent_value:
        return None
    return TraceContextTextMapPropagator().extract({"traceparent": traceparent_value})
