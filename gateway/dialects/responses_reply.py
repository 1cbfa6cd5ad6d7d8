"""A Responses API answer, rendered from the chat route's own (gateway.output.formatters'
ChatFormatter): the same text and tool calls, as OpenAI's response object and its events.

    whole:  chat.completion ──▶ {"object": "response", "status", "output": [a message item
            with one output_text part, function_call items (call_id, name, arguments)],
            "usage", and the request's settings echoed}
    stream: chat chunks ──▶ response.created, response.in_progress; per item
            response.output_item.added, then for a message response.content_part.added,
            response.output_text.delta..., response.output_text.done,
            response.content_part.done, and for a call response.function_call_arguments.delta,
            response.function_call_arguments.done; response.output_item.done; at the end
            response.completed (or response.incomplete). Each event has its `type` and a
            `sequence_number`, and is framed `event: <type>` + `data: <json>`, no [DONE].

A length cut is status "incomplete" with incomplete_details.reason "max_output_tokens"; a
stream's deadline, "incomplete" with reason "timeout" (an answer not streamed is a 504 then).
An error inside a stream is OpenAI's `error` event, which also carries the chat stream's error
object, so the openai SDK raises it as it does a chat stream's.
"""

from __future__ import annotations

from typing import Any

from gateway.dialects.responses import ResponsesRequest, chat_param
from gateway.http.errors import error_body
from gateway.http.streaming import sse_typed_event
from gateway.output.formatters import ChatFormatter, Formatter
from gateway.output.generation import ChoiceEvent, Generation
from gateway.prompt.intake import EngineRequest

INCOMPLETE = {"length": "max_output_tokens", "timeout": "timeout"}  # finish -> reason


class ResponsesFormatter(Formatter):
    id_prefix = "resp_"
    closing = None  # the stream ends with its response.completed event

    def __init__(self, req: EngineRequest, gen: Generation) -> None:
        super().__init__(req, gen)
        self.chat = ChatFormatter(req, gen)
        self.asked: ResponsesRequest = req.body.responses  # echoed in the response object
        self.message_id = "msg_" + gen.request_id
        # A stream's state: the events numbered so far, the items done, the one open
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.logprobs: list[dict[str, Any]] = []  # the open message's, as they came
        self.ended = False

    frame = staticmethod(sse_typed_event)

    @classmethod
    def error_shape(cls, status: int, message: str, param: str | None,
                    code: str | None) -> tuple[int, dict[str, Any]]:
        return status, error_body(status, message, chat_param(param), code)

    @classmethod
    def error_chunk(cls, status: int, message: str, code: str | None = None,
                    sequence_number: int = 0) -> dict[str, Any]:
        return {"type": "error", "sequence_number": sequence_number, "code": code,
                "message": message, "param": None, **error_body(status, message, None, code)}

    def stream_error(self, status: int, message: str, code: str | None = None
                     ) -> dict[str, Any]:
        return self.error_chunk(status, message, code, self._next())

    # ---- the response object -----------------------------------------------------------------

    def _usage(self) -> dict[str, Any]:
        gen = self.gen
        return {"input_tokens": gen.prompt_tokens,
                # cache writes are not counted apart: a prompt's new full blocks are kept as
                # they are computed, at no cost of their own
                "input_tokens_details": {"cached_tokens": gen.cached_tokens,
                                         "cache_write_tokens": 0},
                "output_tokens": gen.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": gen.prompt_tokens + gen.completion_tokens}

    def _response(self, finish: str | None, output: list[dict[str, Any]] | None
                  ) -> dict[str, Any]:
        """The response object: in progress (`output` None), or ended by `finish`."""
        asked, body = self.asked, self.body
        status, details = "in_progress", None
        if output is not None:
            reason = INCOMPLETE.get(finish or "")
            status, details = ("incomplete", {"reason": reason}) if reason else ("completed", None)
        fmt = asked.text.format if asked.text and asked.text.format else None
        choice = asked.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None, "incomplete_details": details,
            "instructions": asked.instructions, "max_output_tokens": asked.max_output_tokens,
            "metadata": asked.metadata or {}, "model": self.gen.model.model_id,
            "output": output or [], "parallel_tool_calls": asked.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in asked.tools or []],
            "top_logprobs": asked.top_logprobs or 0, "top_p": body.top_p,
            "truncation": asked.truncation or "disabled",
            "usage": self._usage() if output is not None else None, "user": asked.user}

    def _message(self, text: str, status: str, logprobs: list[dict[str, Any]]
                 ) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_part(text, logprobs)]}

    def _call(self, index: int, call_id: str, name: str, arguments: str, status: str
              ) -> dict[str, Any]:
        return {"id": f"fc_{self.gen.request_id}_{index}", "type": "function_call",
                "status": status, "call_id": call_id, "name": name, "arguments": arguments}

    # ---- whole -------------------------------------------------------------------------------

    def add(self, event: ChoiceEvent) -> None:
        self.chat.add(event)

    def response(self) -> dict[str, Any]:
        [choice] = self.chat.response()["choices"]
        message, finish = choice["message"], choice["finish_reason"]
        done = "incomplete" if finish in INCOMPLETE else "completed"
        calls = message.get("tool_calls") or []
        output = []
        if message.get("content") or not calls:
            logprobs = (choice["logprobs"] or {}).get("content") or []
            output.append(self._message(message.get("content") or "", done, logprobs))
        output += [self._call(i, c["id"], c["function"]["name"], c["function"]["arguments"],
                              "completed") for i, c in enumerate(calls)]
        return self._response(finish, output)

    # ---- streamed ----------------------------------------------------------------------------

    def _next(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": self._next(), **fields}

    def stream_start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._response(None, None)),
                self._event("response.in_progress", response=self._response(None, None))]

    def stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        pieces, finish = self.chat.pieces(event)
        for kind, text, more in pieces:
            if kind == "text":
                out += self._text(text, more)
            elif kind == "call":
                out += self._open_call(text, more)
            else:
                assert self.open is not None
                self.open["arguments"] += text
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=self.open["id"], output_index=len(self.output),
                                       delta=text))
        if finish is not None and not self.ended:
            self.ended = True
            if not self.output and self.open is None:  # nothing said: one empty message
                out += self._open_message()
            out += self._close(finish)
            kind = "response.incomplete" if finish in INCOMPLETE else "response.completed"
            out.append(self._event(kind, response=self._response(finish, self.output)))
        return out

    def stream_end(self) -> list[dict[str, Any]]:
        return []

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = [] if self.open is not None and self.open["type"] == "message" \
            else self._open_message()
        assert self.open is not None
        self.open["text"] += text
        self.logprobs += logprobs
        return out + [self._event("response.output_text.delta", item_id=self.message_id,
                                  output_index=len(self.output), content_index=0, delta=text,
                                  logprobs=logprobs)]

    def _open_message(self) -> list[dict[str, Any]]:
        out = self._close(None)
        self.open = {"type": "message", "id": self.message_id, "text": ""}
        self.logprobs = []  # this message's own
        index = len(self.output)
        return out + [
            self._event("response.output_item.added", output_index=index,
                        item=self._message("", "in_progress", [])),
            self._event("response.content_part.added", item_id=self.message_id,
                        output_index=index, content_index=0, part=_part("", []))]

    def _open_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        out = self._close(None)
        calls = sum(item["type"] == "function_call" for item in self.output)
        item = self._call(calls, call_id, name, "", "in_progress")
        self.open = {**item, "index": calls}
        return out + [self._event("response.output_item.added", output_index=len(self.output),
                                  item=item)]

    def _close(self, finish: str | None) -> list[dict[str, Any]]:
        """The open item's closing events; it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        if item["type"] == "message":
            text, logprobs = item["text"], self.logprobs
            done = self._message(text, "incomplete" if finish in INCOMPLETE else "completed",
                                 logprobs)
            out = [self._event("response.output_text.done", item_id=item["id"],
                               output_index=index, content_index=0, text=text,
                               logprobs=logprobs),
                   self._event("response.content_part.done", item_id=item["id"],
                               output_index=index, content_index=0, part=_part(text, logprobs))]
        else:
            done = self._call(item["index"], item["call_id"], item["name"], item["arguments"],
                              "completed")
            out = [self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, name=item["name"],
                               arguments=item["arguments"])]
        self.output.append(done)
        return out + [self._event("response.output_item.done", output_index=index, item=done)]


def _part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
