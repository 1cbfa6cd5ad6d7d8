"""Small factories for load-generator records, driven through the real event handling."""

from __future__ import annotations

import json

from loadgen.record import RequestRecord


def ok_record(index: int, ttft_s: float, gaps_s: list[float], *, prompt_tokens: int = 10,
              scheduled_s: float = 0.0, lag_s: float = 0.0) -> RequestRecord:
    """A successful streamed request: first token at `ttft_s`, then one chunk after each gap."""
    r = RequestRecord(index, scheduled_s, sent_s=scheduled_s + lag_s, status=200)
    t = ttft_s
    times = [t]
    for g in gaps_s:
        t += g
        times.append(t)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(times)}
    for i, at in enumerate(times):
        last = i == len(times) - 1
        choice = {"index": 0, "text": "x", "finish_reason": "length" if last else None}
        chunk: dict[str, object] = {"choices": [choice]}
        if last:
            chunk["usage"] = usage
        r.on_event(json.dumps(chunk), at, 0.0)
    r.on_event(json.dumps({"choices": [], "usage": usage}), t, 0.0)
    r.on_event("[DONE]", t, 0.0)
    r.e2e_s = t
    return r


def rejected_record(index: int) -> RequestRecord:
    return RequestRecord(index, 0.0, status=429, error="HTTP 429: queue full", e2e_s=0.001)


def error_record(index: int, status: int = 500) -> RequestRecord:
    return RequestRecord(index, 0.0, status=status, error=f"HTTP {status}: boom", e2e_s=0.002)
