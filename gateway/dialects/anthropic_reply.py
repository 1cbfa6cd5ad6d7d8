"""A Messages API answer, rendered from the chat route's own (gateway.output.formatters'
ChatFormatter): the same text and tool calls, in Anthropic's shapes.

    whole:  chat.completion ──▶ {"type": "message", "content": [text block, tool_use blocks],
                                 "stop_reason", "stop_sequence", "usage"}
    stream: chat chunks ──▶ message_start, then per block content_block_start /
            content_block_delta (text_delta, input_json_delta) / content_block_stop, then
            message_delta (stop_reason, output_tokens) and message_stop; every event framed as
            `event: <type>` + `data: <json>`, no [DONE]
"""

from __future__ import annotations

import json
from typing import Any

from gateway.dialects.anthropic import error_body, error_status
from gateway.http.streaming import sse_typed_event
from gateway.output.formatters import ChatFormatter, Formatter
from gateway.output.generation import ChoiceEvent, Generation
from gateway.prompt.intake import EngineRequest

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # others: end_turn


class MessagesFormatter(Formatter):
    id_prefix = "msg_"
    closing = None  # the stream ends with its message_stop event

    def __init__(self, req: EngineRequest, gen: Generation) -> None:
        super().__init__(req, gen)
        self.chat = ChatFormatter(req, gen)
        self.block: str | None = None  # the open block's type in a stream
        self.blocks = 0  # blocks opened so far in a stream
        self.ended = False

    frame = staticmethod(sse_typed_event)

    @classmethod
    def error_shape(cls, status: int, message: str, param: str | None,
                    code: str | None) -> tuple[int, dict[str, Any]]:
        return error_status(status), error_body(status, message)

    def _stop(self, finish: str | None) -> tuple[str, str | None]:
        """stop_reason and stop_sequence for the chat's finish reason."""
        matched = self.gen.choices[0].detok.matched_stop if self.gen.choices else None
        if finish == "stop" and matched is not None:
            return "stop_sequence", matched
        return STOP_REASONS.get(finish or "", "end_turn"), None

    def _usage(self) -> dict[str, int]:
        return {"input_tokens": self.gen.prompt_tokens,
                "output_tokens": self.gen.completion_tokens}

    # ---- whole -------------------------------------------------------------------------------

    def add(self, event: ChoiceEvent) -> None:
        self.chat.add(event)

    def response(self) -> dict[str, Any]:
        [choice] = self.chat.response()["choices"]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": call["id"],
                            "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"] or "{}")})
        stop_reason, stop_sequence = self._stop(choice["finish_reason"])
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.gen.model.model_id, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self._usage()}

    # ---- streamed ----------------------------------------------------------------------------

    def stream_start(self) -> list[dict[str, Any]]:
        message = {"id": self.id, "type": "message", "role": "assistant",
                   "model": self.gen.model.model_id, "content": [], "stop_reason": None,
                   "stop_sequence": None,
                   "usage": {"input_tokens": self.gen.prompt_tokens, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}]

    def stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        pieces, finish = self.chat.pieces(event)
        for kind, text, more in pieces:
            if kind == "text":
                if self.block != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": text}))
            elif kind == "call":
                out += self._open({"type": "tool_use", "id": text, "name": more, "input": {}})
            else:
                out.append(self._delta({"type": "input_json_delta", "partial_json": text}))
        if finish is not None and not self.ended:
            self.ended = True
            out += self._close()
            stop_reason, stop_sequence = self._stop(finish)
            out.append({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": {"output_tokens": self.gen.completion_tokens}})
            out.append({"type": "message_stop"})
        return out

    def stream_end(self) -> list[dict[str, Any]]:
        return []

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.block = block["type"]
        self.blocks += 1
        return out + [{"type": "content_block_start", "index": self.blocks - 1,
                       "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        self.block = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]
