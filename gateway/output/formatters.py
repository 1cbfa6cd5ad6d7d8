"""How each route renders ChoiceEvents as OpenAI's (or our native) JSON shapes. No I/O, no
request intake (gateway.prompt.intake): a formatter is built, complete, once its request has a
Generation, and its exchange (gateway.api.exchange) feeds it events. Which route renders with
which formatter is its record's say (gateway.dialects.served).

Streamed and non-streamed answers are built from the same ChoiceEvents, so the joined text of a
stream equals the text of the non-streamed answer for the same request.
"""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import replace
from typing import Any

from gateway.http.errors import error_body
from gateway.http.streaming import KEEPALIVE, sse_event
from gateway.output.generation import ChoiceEvent, EngineFailure, Generation
from gateway.output.reasoning import Reasoning, split
from gateway.output.reasoning import fields as reasoning_fields
from gateway.prompt.intake import EngineRequest

DONE = b"data: [DONE]\n\n"


class Formatter:
    chunk_object = ""  # the "object" of a stream chunk
    id_prefix = "cmpl-"
    closing: bytes | None = DONE  # what a stream ends with, after its last event
    keepalive: bytes | None = KEEPALIVE  # sent while a stream has nothing to say; None: never
    media_type = "text/event-stream; charset=utf-8"  # a stream's

    # ---- the dialect's framing and errors (OpenAI's here; gateway.dialects may differ) -------

    @staticmethod
    def frame(chunk: dict[str, Any]) -> bytes:
        """One stream event, as the wire carries it."""
        return sse_event(chunk)

    @classmethod
    def error_chunk(cls, status: int, message: str, code: str | None = None) -> dict[str, Any]:
        """An error sent inside a stream that already answered 200: the dialect's error body."""
        return cls.error_shape(status, message, None, code)[1]

    @classmethod
    def error_shape(cls, status: int, message: str, param: str | None,
                    code: str | None) -> tuple[int, dict[str, Any]]:
        """An error answered before the stream or the JSON: its status and body."""
        return status, error_body(status, message, param, code)

    def stream_error(self, status: int, message: str, code: str | None = None
                     ) -> dict[str, Any]:
        """An error event of this formatter's stream, once it began (a dialect that numbers its
        events gives the error its place)."""
        return self.error_chunk(status, message, code)

    def __init__(self, req: EngineRequest, gen: Generation) -> None:
        self.body = req.body
        self.model = req.model
        self.tool_plan = req.tool_plan  # chat with callable tools (gateway/prompt/tools.py)
        self.gen = gen
        self.id = self.id_prefix + gen.request_id
        # when the request arrived (a streamed request may have waited in the queue since)
        self.created = int(time.time() - (time.monotonic() - req.arrival))
        n = gen.params.n
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.logprobs: list[list[list]] = [[] for _ in range(n)]
        self.sent_first_token = False  # the native stream puts ttft_ms on its first token

    # ---- non-streamed ------------------------------------------------------------------------

    async def collect(self) -> dict[str, Any]:
        """The whole generation, rendered as one response."""
        async for event in self.gen.events():
            self.add(event)
        return self.response()

    def add(self, event: ChoiceEvent) -> None:
        self.texts[event.index].append(event.text)
        if event.logprobs:
            self.logprobs[event.index].extend(event.logprobs)

    def text(self, index: int) -> str:
        return "".join(self.texts[index])

    def usage(self) -> dict[str, Any]:
        return self.gen.usage()

    def timings(self) -> dict[str, Any]:
        return self.gen.timings.as_dict(self.gen.completion_tokens)

    def token_str(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- hooks for subclasses ---------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        raise NotImplementedError

    def stream_start(self) -> list[dict[str, Any]]:
        return []

    def stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        raise NotImplementedError

    def stream_end(self) -> list[dict[str, Any]]:
        if self.body.include_usage:  # the last chunk: it carries timings too
            return [self._chunk([], usage=self.usage(), timings=self.timings())]
        return []

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.gen.model.model_id, "choices": choices, **extra}

    def _final_extras(self, event: ChoiceEvent) -> dict[str, Any]:
        if event.finish_reason is None:
            return {}
        return {"usage": self.usage(), "timings": self.timings()}


class CompletionFormatter(Formatter):
    chunk_object = "text_completion"

    def _echo(self) -> str:
        b = self.body
        if not b.echo:
            return ""
        return b.prompt if isinstance(b.prompt, str) else self.model.tokenizer.decode(b.prompt)

    def _logprobs(self, entries: list[list]) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        tokens = [self.token_str(e[0]) for e in entries]
        offsets, pos = [], len(self._echo())
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [{self.token_str(t): lp for t, lp in e[2]} for e in entries],
                "text_offset": offsets}

    def response(self) -> dict[str, Any]:
        choices = [{"index": i, "text": self._echo() + self.text(i),
                    "logprobs": self._logprobs(self.logprobs[i]),
                    "finish_reason": self.gen.finish_reasons[i]}
                   for i in range(self.gen.params.n)]
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.gen.model.model_id, "choices": choices, "usage": self.usage(),
                "timings": self.timings()}

    def stream_start(self) -> list[dict[str, Any]]:
        echo = self._echo()
        if not echo:
            return []
        return [self._chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])
                for i in range(self.body.n)]

    def stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        choice = {"index": event.index, "text": event.text,
                  "logprobs": self._logprobs(event.logprobs or []),
                  "finish_reason": event.finish_reason}
        return [self._chunk([choice], **self._final_extras(event))]


class ChatFormatter(Formatter):
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, req: EngineRequest, gen: Generation) -> None:
        super().__init__(req, gen)
        self.tool_streams = [self.tool_plan.stream() for _ in range(gen.params.n)] \
            if self.tool_plan else []
        self.parser = req.reasoning_parser
        self.thinking = [Reasoning(self.parser) for _ in range(gen.params.n)] \
            if self.parser else []

    def _logprobs(self, entries: list[list]) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None

        def item(token_id: int, lp: float) -> dict[str, Any]:
            text = self.token_str(token_id)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**item(e[0], e[1]), "top_logprobs": [item(t, lp) for t, lp in e[2]]}
                            for e in entries]}

    def response(self) -> dict[str, Any]:
        choices = []
        for i in range(self.gen.params.n):
            reasoning, text = split(self.parser, self.text(i)) if self.parser \
                else (None, self.text(i))
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = self.gen.finish_reasons[i]
            if self.tool_plan is not None:  # tool calls parsed out of the text
                message, finish = self.tool_plan.message(text, finish)
            if reasoning is not None:
                message.update(reasoning_fields(reasoning))
            choices.append({"index": i, "message": message,
                            "logprobs": self._logprobs(self.logprobs[i]), "finish_reason": finish})
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.gen.model.model_id, "choices": choices, "usage": self.usage(),
                "timings": self.timings()}

    def stream_start(self) -> list[dict[str, Any]]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for i in range(self.body.n)]

    def stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        thoughts: list[dict[str, Any]] = []
        if self.parser:  # the thinking goes out as its own deltas, the rest as the event's text
            r = self.thinking[event.index]
            pieces = r.feed(event.text) + (r.finish() if event.finish_reason is not None else [])
            thoughts = [{"index": event.index, "delta": reasoning_fields(text), "logprobs": None,
                         "finish_reason": None} for field, text in pieces if field == "reasoning"]
            event = replace(event, text="".join(t for f, t in pieces if f == "content"))
            if thoughts and not event.text and event.finish_reason is None:
                # no empty content delta beside them: the tokens' logprobs go with the thinking
                thoughts[-1]["logprobs"] = self._logprobs(event.logprobs or [])
                return [self._chunk([choice]) for choice in thoughts]
        thoughts = [self._chunk([choice]) for choice in thoughts]
        if self.tool_plan is not None:
            return thoughts + self._tool_stream_event(event)
        choice = {"index": event.index, "delta": {"content": event.text},
                  "logprobs": self._logprobs(event.logprobs or []),
                  "finish_reason": event.finish_reason}
        return thoughts + [self._chunk([choice], **self._final_extras(event))]

    def pieces(self, event: ChoiceEvent) -> tuple[list[tuple[str, Any, Any]], str | None]:
        """What this event adds to the chat stream, for a dialect that renders it in its own
        events: ("text", text, its logprobs), ("call", id, name) as a tool call opens,
        ("arguments", text, None); and the finish reason, once the choice ended."""
        out: list[tuple[str, Any, Any]] = []
        finish = None
        for chunk in self.stream_event(event):
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("content"):
                    out.append(("text", delta["content"],
                                (choice["logprobs"] or {}).get("content") or []))
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    if call.get("id"):
                        out.append(("call", call["id"], fn.get("name", "")))
                    if fn.get("arguments"):
                        out.append(("arguments", fn["arguments"], None))
                finish = choice["finish_reason"] or finish
        return out, finish

    def _tool_stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        """Content passes through; tool calls are sent as tool_calls deltas when the choice
        ends (gateway.prompt.tool_calls)."""
        deltas, finish = self.tool_streams[event.index].feed(event.text, event.finish_reason)
        chunks = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = {"index": event.index, "delta": delta, "logprobs": None,
                      "finish_reason": finish if last else None}
            chunks.append(self._chunk([choice], **(self._final_extras(event) if last else {})))
        if not deltas and event.finish_reason is not None:
            choice = {"index": event.index, "delta": {}, "logprobs": None, "finish_reason": finish}
            chunks.append(self._chunk([choice], **self._final_extras(event)))
        return chunks


class NativeFormatter(Formatter):
    """POST /v1/generate: {prompt, max_new_tokens, ...} -> {text, finish_reason, timings}."""

    def _counts(self) -> dict[str, Any]:
        return {"prompt_tokens": self.gen.prompt_tokens,
                "completion_tokens": self.gen.completion_tokens}

    def response(self) -> dict[str, Any]:
        timings = self.timings()  # flat (the native API's own) and as every route's `timings`
        return {"id": self.id, "model": self.gen.model.model_id, "text": self.text(0),
                "finish_reason": self.gen.finish_reasons[0], **self._counts(), **timings,
                "timings": timings}

    def stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        out: dict[str, Any] = {"text": event.text, "token_ids": event.token_ids}
        if self.gen.timings.first_token is not None and not self.sent_first_token:
            self.sent_first_token = True
            out["ttft_ms"] = self.timings()["ttft_ms"]
        if event.finish_reason is not None:
            timings = self.timings()
            out.update(finish_reason=event.finish_reason, **self._counts(), **timings,
                       timings=timings)
        return [out]


class EmbeddingFormatter(Formatter):
    """POST /v1/embeddings: each input's vector, as floats or, with encoding_format "base64",
    as OpenAI's base64 of its float32 little-endian bytes. Never streamed."""

    def __init__(self, req: EngineRequest, gen: Generation) -> None:
        super().__init__(req, gen)
        self.vectors: list[bytes | None] = [None] * gen.params.n

    def add(self, event: ChoiceEvent) -> None:
        if event.embedding is not None:
            self.vectors[event.index] = event.embedding

    def response(self) -> dict[str, Any]:
        missing = [i for i, v in enumerate(self.vectors) if v is None]
        if missing:  # its worker stopped first (a drain past its timeout): no partial answer
            raise EngineFailure(503, f"the worker ended before input {missing[0]} was embedded "
                                f"({self.gen.finish_reasons[missing[0]]})", "unavailable")
        b64 = self.body.encoding_format == "base64"
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v).decode() if b64  # type: ignore[arg-type]
                 else list(struct.unpack(f"<{len(v) // 4}f", v))}  # type: ignore[arg-type]
                for i, v in enumerate(self.vectors)]
        tokens = self.gen.prompt_tokens
        return {"object": "list", "data": data, "model": self.gen.model.model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        raise NotImplementedError("embeddings are not streamed")

