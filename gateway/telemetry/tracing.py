"""One OpenTelemetry server span per request at the gateway, with the GenAI attribute names.

    Admitter.start: admitted  ──start(gen)──▶ span (start time = the request's arrival),
                        gen.traceparent set ──▶ Generate.traceparent ──▶ the worker's child span
    Accounting.record: any end ──end(...)──▶ usage, finish reasons, status ──▶ span ends

A request refused before admission (401, 422, 429...) still gets its span, opened and closed at
`end`. Spans are kept by engine request id between start and end; `end` always runs (it is
called from the route's one `record` on every exit), so the dict does not grow.
Attribute names follow the OpenTelemetry GenAI semantic conventions (gen_ai.*).
"""

from __future__ import annotations

import time
from typing import Any

from common import telemetry
from gateway.output.generation import Generation

# The route's GenAI operation name (gen_ai.operation.name).
OPERATIONS = {"chat": "chat", "completions": "text_completion", "generate": "generate_content",
              "generate_stream": "generate_content"}
SYSTEM = "kestrel"


def _wall_ns(monotonic_s: float) -> int:
    """A monotonic instant as epoch nanoseconds (what span start times are)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class RequestTracer:
    def __init__(self, endpoint: str) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._kind, self._status, self._code = SpanKind, Status, StatusCode
        self.provider = telemetry.tracer_provider("kestrel-gateway", endpoint)
        self.tracer = self.provider.get_tracer("kestrel.gateway")
        self.spans: dict[str, Any] = {}  # engine request id -> its open span

    @classmethod
    def create(cls, endpoint: str) -> RequestTracer | None:
        """None when no endpoint is set: tracing off, opentelemetry never imported."""
        return cls(endpoint) if endpoint else None

    def start(self, gen: Generation) -> None:
        p = gen.params
        attrs = {"gen_ai.provider.name": SYSTEM, "gen_ai.request.model": gen.model.model_id,
                 "gen_ai.request.max_tokens": p.max_tokens,
                 "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_p": p.top_p,
                 "gen_ai.request.choice.count": p.n, "gen_ai.response.id": gen.request_id,
                 "kestrel.structured_output": gen.grammar is not None}
        if p.top_k:
            attrs["gen_ai.request.top_k"] = p.top_k
        if p.seed is not None:
            attrs["gen_ai.request.seed"] = p.seed
        span = self.tracer.start_span(f"generate {gen.model.model_id}", kind=self._kind.SERVER,
                                      start_time=_wall_ns(gen.timings.arrival), attributes=attrs)
        self.spans[gen.request_id] = span
        gen.traceparent = telemetry.traceparent(span)

    def end(self, route: str, status: int, gen: Generation | None, arrival: float,
            request_id: str, finish: str) -> None:
        operation = OPERATIONS.get(route, route)
        span = self.spans.pop(gen.request_id, None) if gen is not None else None
        if span is None:  # refused before admission: a span of its own, from arrival to now
            span = self.tracer.start_span(operation, kind=self._kind.SERVER,
                                          start_time=_wall_ns(arrival),
                                          attributes={"gen_ai.provider.name": SYSTEM})
        span.set_attribute("gen_ai.operation.name", operation)
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("kestrel.request_id", request_id)
        span.set_attribute("kestrel.finish", finish)
        if gen is not None:
            span.update_name(f"{operation} {gen.model.model_id}")
            span.set_attribute("gen_ai.response.model", gen.model.model_id)
            span.set_attribute("gen_ai.usage.input_tokens", gen.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", gen.completion_tokens)
            span.set_attribute("gen_ai.response.finish_reasons",
                               [r or "none" for r in gen.finish_reasons])
            t = gen.timings
            if t.first_token is not None:
                span.set_attribute("kestrel.ttft_ms", round((t.first_token - arrival) * 1000, 3))
        if status >= 400:
            span.set_attribute("error.type", str(status))
            span.set_status(self._status(self._code.ERROR, finish))
        span.end()

    def shutdown(self) -> None:
        for span in self.spans.values():  # none in a clean stop; still closed, not lost
            span.end()
        self.spans.clear()
        self.provider.shutdown()  # flushes the batch processor
