"""What one request did: a `RequestRecord`, filled in from the stream's events as they arrive.

    SSE data string + arrival time ──▶ RequestRecord.on_event() ──▶ timings, counts, usage, error

A non-streamed response is one event (`on_response`): TTFT equals its whole latency.
Times are seconds on `time.perf_counter()`, stored relative to the run's start (`scheduled_s`,
`sent_s`) or to the request's send (`ttft_s`, `e2e_s`). A "token chunk" is a chunk with a choice,
except the chat preamble (`delta: {role, content: ""}`), which precedes any token; kestrel sends
one token chunk per generated token, except where its gateway fell behind the worker and sent
the backlog as one chunk, or speculative decoding sent a step's accepted drafts together, so
`n_chunks` is at most `completion_tokens` there (TPOT counts tokens, ITL chunks). Token
totals come from the server's `usage` (it is sent on the last choice chunk and again in the
include_usage chunk; both carry the same totals, so the last one seen wins).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

DONE = "[DONE]"


@dataclass
class RequestRecord:
    index: int
    scheduled_s: float  # when the schedule wanted it sent, from the run's start
    sent_s: float = 0.0  # when its task actually began sending, from the run's start
    status: int = 0  # HTTP status; 0: no response at all (connection error, timeout)
    error: str | None = None
    ttft_s: float | None = None  # send -> first token chunk
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive token chunks
    e2e_s: float | None = None  # send -> end of stream ([DONE]) or of the failed response
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    n_chunks: int = 0
    finish_reason: str | None = None
    done: bool = False  # saw `data: [DONE]`
    shared_prefix: bool = False
    target_prompt_len: int = 0
    target_output_len: int = 0
    # Absolute perf_counter times of the first and last token chunks, for the gaps.
    _first_t: float | None = field(default=None, repr=False)
    _last_t: float | None = field(default=None, repr=False)

    @property
    def rejected(self) -> bool:
        """429: the server refused at admission. Counted apart from errors: it is load shedding
        working as designed, and an open loop at high rates expects it."""
        return self.status == 429

    @property
    def ok(self) -> bool:
        # A stream that ended on its deadline (finish_reason "timeout") did not deliver what was
        # asked: it counts as a failure, not as a completed request.
        return self.status == 200 and self.error is None and self.finish_reason != "timeout"

    @property
    def failed(self) -> bool:
        return not self.ok and not self.rejected

    @property
    def send_lag_s(self) -> float:
        return self.sent_s - self.scheduled_s

    @property
    def tpot_s(self) -> float | None:
        """(last chunk - first chunk) / (tokens - 1), as vLLM's benchmark defines it: the mean
        time per output token after the first. Tokens: the server's completion_tokens where it
        gave them (a chunk may carry several: speculative decoding's accepted drafts, or a
        backlog the gateway joined; dividing by the chunks counted such a chunk's tokens as one
        and overstated the time a token took), the token chunks otherwise. None below 2."""
        if self._first_t is None or self._last_t is None or self.n_chunks < 2:
            return None
        tokens = max(self.n_chunks, self.completion_tokens or 0)
        return (self._last_t - self._first_t) / (tokens - 1)

    def on_event(self, data: str, now: float, sent_at: float) -> bool:
        """Apply one SSE data payload that arrived at `now` (perf_counter) for a request sent at
        `sent_at`. Returns True at `[DONE]`, the end of the stream."""
        if data.strip() == DONE:
            self.done = True
            return True
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad SSE payload: {data[:200]!r}"
            return False
        if not isinstance(obj, dict):
            self.error = f"bad SSE payload: {data[:200]!r}"
            return False
        if "error" in obj:
            self.error = error_text(obj)
            return False
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        choices = obj.get("choices") or []
        if any(_carries_token(c) for c in choices):
            self._token_chunk(now, sent_at)
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return False

    def on_response(self, obj: Any, now: float, sent_at: float) -> None:
        """Apply a whole (non-streamed) response that arrived at `now`. Its first token reached
        the client with all the others, so TTFT is the whole latency and there are no gaps."""
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
            self.error = f"bad response: {json.dumps(obj)[:200]}"
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = usage.get("prompt_tokens")
            self.completion_tokens = usage.get("completion_tokens")
        self._token_chunk(now, sent_at)
        for choice in obj["choices"]:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        self.done = True

    def _token_chunk(self, now: float, sent_at: float) -> None:
        if self._first_t is None:
            self._first_t = now
            self.ttft_s = now - sent_at
        else:
            self.itl_s.append(now - (self._last_t or now))
        self._last_t = now
        self.n_chunks += 1

    def to_dict(self, itl: bool = True) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d.update(rejected=self.rejected, ok=self.ok, send_lag_s=self.send_lag_s, tpot_s=self.tpot_s)
        if not itl:
            d.pop("itl_s")
        return d


def _carries_token(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict) and "role" in delta and not delta.get("content") \
            and not delta.get("tool_calls") and choice.get("finish_reason") is None:
        return False  # the chat preamble: announces the role, carries no token
    return True


def error_text(payload: Any) -> str:
    """The message of an OpenAI-shaped error ({"error": {"message": ...}}), else the raw text."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError:
            return payload[:500]
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])[:500]
    if isinstance(err, str):
        return err[:500]
    return json.dumps(payload)[:500]
