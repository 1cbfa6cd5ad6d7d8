"""How each route turns a body into a request, and ChoiceEvents into OpenAI's (or our native)
JSON shapes. No I/O here: `routes.run_route` drives these.

Streamed and non-streamed answers are built from the same ChoiceEvents, so the joined text of a
stream equals the text of the non-streamed answer for the same request.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from pydantic import BaseModel

from gateway.errors import APIError
from gateway.generation import ChoiceEvent, Generation
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    RequestLimitError,
    check_limits,
)
from gateway.service import GatewayState, Prepared
from gateway.structured import request_grammar
from gateway.tokenizer import ChatTemplateError
from gateway.tools import ToolPlan, ToolStream, render_messages


class Formatter:
    schema: ClassVar[type[BaseModel]]
    chunk_object: ClassVar[str] = ""  # the "object" of a stream chunk
    # max_tokens when a request sets none (then also cut to what the deadline fits): OpenAI's
    # 16 for completions; for chat, enough for an answer, not the whole context.
    default_max_tokens: ClassVar[int] = 16

    def __init__(self, state: GatewayState, body: Any) -> None:
        self.state = state
        self.body = body
        self.created = int(time.time())
        self.gen: Generation | None = None
        self.texts: list[list[str]] = []
        self.logprobs: list[list[list]] = []
        self.sent_first_token = False  # the native stream puts ttft_ms on its first token
        self.tool_plan: ToolPlan | None = None  # chat with callable tools (gateway/tools.py)

    @property
    def stream(self) -> bool:
        return bool(getattr(self.body, "stream", False))

    def bind(self, gen: Generation) -> None:
        self.gen = gen
        self.id = self.id_prefix() + gen.request_id
        self.texts = [[] for _ in range(gen.params.n)]
        self.logprobs = [[] for _ in range(gen.params.n)]

    def id_prefix(self) -> str:
        return "cmpl-"

    async def _prepare(self, arrival: float, prompt_chars: int, tokenize: Any, *args: Any,
                       max_tokens: int | None, stop: list[str], **params: Any) -> Prepared:
        cfg = self.state.cfg
        if getattr(self.body, "logit_bias", None):
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias",
                           code="unsupported_parameter")
        try:
            check_limits(prompt_chars, max_tokens, max_prompt_chars=cfg.max_prompt_chars,
                         max_tokens_cap=cfg.max_tokens_cap)
        except RequestLimitError as exc:
            raise APIError(422, str(exc), param=exc.param, code="invalid_value") from None
        # Structured output / tool grammar: a bad one is a 400 before anything is tokenized.
        tools_lark = self.tool_plan.lark() if self.tool_plan else None
        grammar = await request_grammar(self.body, tools_lark)
        model = self.state.resolve_model(getattr(self.body, "model", None))
        self.model = model
        try:
            ids = await self.state.tokenize(tokenize(model), *args)
        except ChatTemplateError as exc:
            raise APIError(400, f"chat template: {exc}", param="messages") from None
        if not ids:
            raise APIError(422, "the prompt has no tokens", param="prompt", code="invalid_value")
        vocab = model.tokenizer.vocab_size
        if max(ids) >= vocab:  # only a prompt sent as token ids can fail this
            raise APIError(400, f"prompt token ids must be below the vocabulary size ({vocab})",
                           param="prompt", code="invalid_token_ids")
        deadline = self.state.deadline(arrival, getattr(self.body, "timeout", None))
        sampling = self.state.make_params(model, len(ids), max_tokens, self.default_max_tokens,
                                          deadline, **params)
        return Prepared(model, ids, sampling, stop, deadline, arrival, grammar)

    def _common_params(self) -> dict[str, Any]:
        b = self.body
        return dict(temperature=b.temperature, top_p=b.top_p, top_k=b.top_k, seed=b.seed,
                    ignore_eos=b.ignore_eos, speculative=b.speculative)

    # ---- non-streamed ------------------------------------------------------------------------

    def add(self, event: ChoiceEvent) -> None:
        self.texts[event.index].append(event.text)
        if event.logprobs:
            self.logprobs[event.index].extend(event.logprobs)

    def text(self, index: int) -> str:
        return "".join(self.texts[index])

    def usage(self) -> dict[str, Any]:
        assert self.gen is not None
        return self.gen.usage()

    def timings(self) -> dict[str, Any]:
        assert self.gen is not None
        return self.gen.timings.as_dict(self.gen.completion_tokens)

    def token_str(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- hooks for subclasses ---------------------------------------------------------------

    async def prepare(self, arrival: float) -> Prepared:
        raise NotImplementedError

    def response(self) -> dict[str, Any]:
        raise NotImplementedError

    def stream_start(self) -> list[dict[str, Any]]:
        return []

    def stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        raise NotImplementedError

    def stream_end(self) -> list[dict[str, Any]]:
        if getattr(self.body, "include_usage", False):  # the last chunk: it carries timings too
            return [self._chunk([], usage=self.usage(), timings=self.timings())]
        return []

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        assert self.gen is not None
        return {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.gen.model.model_id, "choices": choices, **extra}

    def _final_extras(self, event: ChoiceEvent) -> dict[str, Any]:
        if event.finish_reason is None:
            return {}
        return {"usage": self.usage(), "timings": self.timings()}


class CompletionFormatter(Formatter):
    schema = CompletionRequest
    chunk_object = "text_completion"

    async def prepare(self, arrival: float) -> Prepared:
        b: CompletionRequest = self.body
        if isinstance(b.prompt, list) and b.prompt and isinstance(b.prompt[0], str):
            if len(b.prompt) != 1:
                raise APIError(422, "batched prompts are not supported: send one prompt",
                               param="prompt", code="invalid_value")
            b = b.model_copy(update={"prompt": b.prompt[0]})
            self.body = b
        if isinstance(b.prompt, str):
            chars, tokenize, args = len(b.prompt), (lambda mdl: mdl.tokenizer.encode), (b.prompt,)
        else:
            chars, tokenize, args = len(b.prompt), (lambda mdl: list), (b.prompt,)
        return await self._prepare(
            arrival, chars, tokenize, *args, max_tokens=b.max_tokens, stop=b.stop_list(),
            presence_penalty=b.presence_penalty, frequency_penalty=b.frequency_penalty,
            logprobs=b.logprobs, n=b.n, **self._common_params())

    def _echo(self) -> str:
        assert self.gen is not None
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
        assert self.gen is not None
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
    schema = ChatCompletionRequest
    chunk_object = "chat.completion.chunk"
    default_max_tokens = 512

    def id_prefix(self) -> str:
        return "chatcmpl-"

    async def prepare(self, arrival: float) -> Prepared:
        b: ChatCompletionRequest = self.body
        self.tool_plan = ToolPlan.from_request(b)
        self.tool_streams = [ToolStream(self.tool_plan) for _ in range(b.n)] if self.tool_plan \
            else []
        # Tool calls and results become plain turns; tools go into the system message.
        messages = render_messages(b.messages, b.tools if self.tool_plan else None)
        chars = sum(len(msg["content"]) for msg in messages)

        def tokenize(model: Any) -> Any:
            tok, cfg = model.tokenizer, self.state.cfg
            # max_prompt_chars counts the messages' text; the template's own text is bounded too.
            return lambda msgs: tok.encode(tok.apply_chat_template(
                msgs, max_chars=cfg.rendered_prompt_limit, timeout_s=cfg.template_timeout_s),
                add_special_tokens=False)

        top = (b.top_logprobs or 0) if b.logprobs else None
        return await self._prepare(
            arrival, chars, tokenize, messages, max_tokens=b.requested_max_tokens(),
            stop=b.stop_list(), presence_penalty=b.presence_penalty,
            frequency_penalty=b.frequency_penalty, logprobs=top, n=b.n, **self._common_params())

    def _logprobs(self, entries: list[list]) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None

        def item(token_id: int, lp: float) -> dict[str, Any]:
            text = self.token_str(token_id)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**item(e[0], e[1]), "top_logprobs": [item(t, lp) for t, lp in e[2]]}
                            for e in entries]}

    def response(self) -> dict[str, Any]:
        assert self.gen is not None
        choices = []
        for i in range(self.gen.params.n):
            message: dict[str, Any] = {"role": "assistant", "content": self.text(i)}
            finish = self.gen.finish_reasons[i]
            if self.tool_plan is not None:  # tool calls parsed out of the text
                message, finish = self.tool_plan.message(self.text(i), finish)
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
        if self.tool_plan is not None:
            return self._tool_stream_event(event)
        choice = {"index": event.index, "delta": {"content": event.text},
                  "logprobs": self._logprobs(event.logprobs or []),
                  "finish_reason": event.finish_reason}
        return [self._chunk([choice], **self._final_extras(event))]

    def _tool_stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        """Content passes through; a tool call is sent as tool_calls deltas when it is whole."""
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

    schema = GenerateRequest

    async def prepare(self, arrival: float) -> Prepared:
        b: GenerateRequest = self.body
        return await self._prepare(
            arrival, len(b.prompt), lambda mdl: mdl.tokenizer.encode, b.prompt,
            max_tokens=b.max_new_tokens, stop=b.stop_list(), n=1, **self._common_params())

    def _counts(self) -> dict[str, Any]:
        assert self.gen is not None
        return {"prompt_tokens": self.gen.prompt_tokens,
                "completion_tokens": self.gen.completion_tokens}

    def response(self) -> dict[str, Any]:
        assert self.gen is not None
        timings = self.timings()  # flat (the native API's own) and as every route's `timings`
        return {"id": self.id, "model": self.gen.model.model_id, "text": self.text(0),
                "finish_reason": self.gen.finish_reasons[0], **self._counts(), **timings,
                "timings": timings}

    def stream_event(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        assert self.gen is not None
        out: dict[str, Any] = {"text": event.text, "token_ids": event.token_ids}
        if self.gen.timings.first_token is not None and not self.sent_first_token:
            self.sent_first_token = True
            out["ttft_ms"] = self.timings()["ttft_ms"]
        if event.finish_reason is not None:
            timings = self.timings()
            out.update(finish_reason=event.finish_reason, **self._counts(), **timings,
                       timings=timings)
        return [out]


class NativeStreamFormatter(NativeFormatter):
    @property
    def stream(self) -> bool:
        return True


FORMATTERS: dict[str, type[Formatter]] = {
    "completions": CompletionFormatter,
    "chat": ChatFormatter,
    "generate": NativeFormatter,
    "generate_stream": NativeStreamFormatter,
}
