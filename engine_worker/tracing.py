"""The worker's span per request: a child of the gateway's span, with lifecycle events.

    Generate (traceparent) ──received──▶ span "engine generate", event "queued"
    first token frame sent ──output──▶ event "first_token"
    last frame sent ──finished──▶ event "finished", usage attributes, span ends

Never a span per token: a request is one span with three events. Off (None, nothing imported)
when the worker has no OTLP endpoint. Spans live in a dict from received to finished; a request
refused by the engine ends its span at once with an error status.
"""

from __future__ import annotations

from typing import Any

from common import telemetry
from protocol import messages as m


class WorkerTracer:
    def __init__(self, endpoint: str, worker_id: str) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._kind, self._status, self._code = SpanKind, Status, StatusCode
        self.provider = telemetry.tracer_provider("kestrel-worker", endpoint,
                                                  {"service.instance.id": worker_id})
        self.tracer = self.provider.get_tracer("kestrel.worker")
        self.spans: dict[str, Any] = {}
        self.tokens: dict[str, dict[int, int]] = {}  # request -> choice -> completion tokens

    @classmethod
    def create(cls, endpoint: str, worker_id: str) -> WorkerTracer | None:
        return cls(endpoint, worker_id) if endpoint else None

    def received(self, msg: m.Generate) -> None:
        span = self.tracer.start_span(
            "engine generate", context=telemetry.parent_context(msg.traceparent),
            kind=self._kind.CONSUMER,
            attributes={"kestrel.request_id": msg.request_id,
                        "gen_ai.request.max_tokens": msg.params.max_tokens,
                        "gen_ai.request.choice.count": msg.params.n,
                        "gen_ai.usage.input_tokens": len(msg.prompt_token_ids),
                        "kestrel.structured_output": msg.grammar is not None})
        span.add_event("queued")
        self.spans[msg.request_id] = span
        self.tokens[msg.request_id] = {}

    def refused(self, request_id: str, reason: str) -> None:
        span = self.spans.pop(request_id, None)
        self.tokens.pop(request_id, None)
        if span is not None:
            span.set_status(self._status(self._code.ERROR, reason))
            span.end()

    def output(self, out: m.TokenOutput) -> None:
        counts = self.tokens.get(out.request_id)
        span = self.spans.get(out.request_id)
        if counts is None or span is None:
            return
        if out.token_ids and not any(counts.values()):
            span.add_event("first_token")
        counts[out.index] = max(counts.get(out.index, 0), out.completion_tokens)

    def finished(self, request_id: str, out: m.TokenOutput, reasons: list[str]) -> None:
        span = self.spans.pop(request_id, None)
        counts = self.tokens.pop(request_id, {})
        if span is None:
            return
        span.add_event("finished", {"finish_reasons": reasons})
        span.set_attribute("gen_ai.usage.output_tokens", sum(counts.values()))
        span.set_attribute("gen_ai.response.finish_reasons", reasons)
        span.set_attribute("kestrel.cached_tokens", out.cached_tokens)
        span.end()

    def shutdown(self) -> None:
        for span in self.spans.values():
            span.end()
        self.spans.clear()
        self.provider.shutdown()
