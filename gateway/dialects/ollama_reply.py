"""An Ollama API answer, rendered from the chat (or completion) route's own formatter: the same
text and tool calls, as Ollama's JSON objects, one a line when streamed (application/x-ndjson).

    /api/chat:     {model, created_at, message: {role, content, tool_calls?}, done, done_reason,
                    total_duration, load_duration, prompt_eval_count, prompt_eval_duration,
                    eval_count, eval_duration}    (durations in nanoseconds, as Ollama's)
    /api/generate: the same with `response` (the text) in place of `message`
    stream: one object per step's text, `done: false`; the last one `done: true` with the counts
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

from gateway.dialects.ollama import error_body
from gateway.http.schemas import ChatCompletionRequest
from gateway.output.formatters import ChatFormatter, CompletionFormatter, Formatter
from gateway.output.generation import ChoiceEvent, Generation
from gateway.prompt.intake import EngineRequest


class OllamaFormatter(Formatter):
    closing = None  # the last line says done
    keepalive = None  # a JSON-lines reader takes every line as an object: no comments
    media_type = "application/x-ndjson"
    text_field = "message"  # /api/chat; /api/generate says "response"

    def __init__(self, req: EngineRequest, gen: Generation) -> None:
        super().__init__(req, gen)
        self.inner: Formatter = (ChatFormatter(req, gen) if isinstance(req.body,
                                                                      ChatCompletionRequest)
                                 else CompletionFormatter(req, gen))
        self.arrival = req.arrival

    @staticmethod
    def frame(chunk: dict[str, Any]) -> bytes:
        return json.dumps(chunk, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def error_shape(cls, status: int, message: str, param: str | None,
                    code: str | None) -> tuple[int, dict[str, Any]]:
        return status, error_body(status, message)

    def _head(self) -> dict[str, Any]:
        return {"model": self.gen.model.model_id,
                "created_at": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}

    def _body(self, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.text_field == "response":
            return {"response": text}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [{"function": {
                "name": c["function"]["name"],
                "arguments": json.loads(c["function"]["arguments"] or "{}")}} for c in calls]
        return {"message": message}

    def _done(self, finish: str | None) -> dict[str, Any]:
        t = self.gen.timings
        now = time.monotonic()
        first = t.first_token if t.first_token is not None else now
        return {"done": True, "done_reason": "length" if finish == "length" else "stop",
                "total_duration": int((now - self.arrival) * 1e9), "load_duration": 0,
                "prompt_eval_count": self.gen.prompt_tokens,
                "prompt_eval_duration": int(max(0.0, first - self.arrival) * 1e9),
                "eval_count": self.gen.completion_tokens,
                "eval_duration": int(max(0.0, now - first) * 1e9)}

    # ---- whole -------------------------------------------------------------------------------

    def add(self, event: ChoiceEvent) -> None:
        self.inner.add(event)

    def response(self) -> dict[str, Any]:
        [choice] = self.inner.response()["choices"]
        if "message" in choice:
            text, calls = choice["message"].get("content") or "", choice["message"].get(
                "tool_calls")
        else:
            text, calls = choice["text"], None
        return {**self._head(), **self._body(text, calls), **self._done(choice["finish_reason"])}

    # ---- streamed ----------------------------------------------------------------------------

    def stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        text, deltas, finish = "", [], None
        for chunk in self.inner.stream_event(event):
            for choice in chunk["choices"]:
                delta = choice.get("delta")
                text += (delta.get("content") or "") if delta is not None else choice["text"]
                deltas += (delta.get("tool_calls") or []) if delta is not None else []
                finish = choice["finish_reason"] or finish
        out = []
        if text or deltas:  # a tool call goes out whole, as Ollama sends it
            out.append({**self._head(), **self._body(text, _whole(deltas)), "done": False})
        if finish is not None:
            out.append({**self._head(), **self._body(""), **self._done(finish)})
        return out

    def stream_end(self) -> list[dict[str, Any]]:
        return []


class OllamaGenerateFormatter(OllamaFormatter):
    text_field = "response"


def _whole(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's tool-call deltas of one chunk, joined into whole calls."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        fn = d.get("function") or {}
        if d.get("id"):
            calls.append({"function": {"name": fn.get("name", ""),
                                       "arguments": fn.get("arguments") or ""}})
        elif calls:
            calls[-1]["function"]["arguments"] += fn.get("arguments") or ""
    return calls
