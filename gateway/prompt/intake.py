"""From a request body to an engine request, each part decided once.

    read: the body (413/408/400, gateway.http.body) ──parse──▶ the route's schema (422)
          ──▶ Draft: the body and its deadline (arrival + its timeout, up to --max-timeout-s;
              none asked: --default-timeout-s, none by default)
    prepare: model (404/503) ──▶ the prompt (the route's: text, token ids, or chat messages
             with tools, in the model template's own format where it has one: gateway.prompt.tools)
          ──▶ limits (422) ──▶ grammar (400) ──▶ tokens, in a thread (400)
          ──▶ sampling parameters: max_tokens within the cap and the context (400); absent, the
              route's default (a chat: the rest of the context) ──▶ EngineRequest

Between `read` and `prepare` the route takes the request's place in the admission queue (the
429 is decided before anything is tokenized). Nothing here is written to a socket: the
EngineRequest is what gateway.admission.admit sends and what the formatters render from.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request

from gateway import offload
from gateway.config import GatewayConfig
from gateway.engine.engine_client import EngineClient, ModelEntry
from gateway.http.body import Readers, read_json
from gateway.http.errors import APIError, too_many_requests, validated
from gateway.http.schemas import (
    ChatCompletionRequest,
    EmbeddingRequest,
    RequestLimitError,
    check_limits,
)
from gateway.prompt.structured import request_grammar
from gateway.prompt.tenancy import cache_salt
from gateway.prompt.tools import ToolPlan, render_messages, template_messages, template_tools
from gateway.tokens.tokenizer import ChatTemplateError, GatewayTokenizer
from protocol import messages as m

Encode = Callable[[GatewayTokenizer], list[int]]  # runs in a thread: a long prompt is CPU work


@dataclass(frozen=True)
class Route:
    """How intake reads one engine route's body: the reading part of the route's one record
    (gateway.dialects.record), handed to `read` by the route's exchange."""

    name: str  # the route's name: its metrics' and its log line's label
    schema: type[BaseModel]  # what its body is validated as (and /openapi.json documents)
    # max_tokens when a request sets none, within the cap: OpenAI's 16 for completions; None:
    # the rest of the context (a chat runs to its stop, as vLLM's does). Never cut to fit an
    # estimate: a deadline is met by refusing at once, not by a shorter answer.
    default_max_tokens: int | None = 16
    stream: bool | None = None  # None: the body's own `stream`
    generates: bool = True  # False: its prompt is all its work (embeddings)
    # Another dialect's body (gateway.dialects): validated in its own terms (`schema`) and
    # returned as the request it asks for (a chat or a completion request).
    parse: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Draft:
    """A valid body and its deadline: enough to take a place in the queue."""

    route: Route  # the way it came in
    body: Any  # the route's schema, a RequestBase
    arrival: float  # monotonic
    deadline: float | None  # monotonic; None: none
    stream: bool  # answered as SSE
    address: str = ""  # the client's address: who it is when API keys are off
    prompt_chars: int = 0  # the prompt's characters: a bound on its tokens before tokenizing


@dataclass
class EngineRequest:
    """What the engine is asked, and what the response is rendered from."""

    route: str  # its route's name
    body: Any  # the body as the formatter reads it (a one-prompt batch is unwrapped)
    arrival: float  # monotonic
    deadline: float | None  # monotonic; None: none
    stream: bool
    model: ModelEntry
    prompt_ids: list[int]
    params: m.SamplingParams
    stop: list[str]
    grammar: str | None = None  # structured output (gateway/prompt/structured.py)
    cache_salt: str = ""  # the prefix cache's tenant (gateway/prompt/tenancy.py)
    tool_plan: ToolPlan | None = None  # chat with callable tools (gateway/prompt/tools.py)
    skip_special_tokens: bool = True  # in the text: special tokens dropped
    include_stop: bool = False  # in the text: the matched stop string kept
    reasoning_parser: str = ""  # a chat's <think> returned apart (gateway/output/reasoning.py)
    # Embeddings: the prompt is these inputs end to end, one vector each (params.n of them).
    input_lengths: list[int] = field(default_factory=list)

    @property
    def embed(self) -> bool:
        return bool(self.input_lengths)


def parse_body(schema: type[BaseModel], data: Any) -> Any:
    """An OpenAI route's body (a dialect's goes through its own `parse`)."""
    return validated(schema, data)


class Intake:
    def __init__(self, cfg: GatewayConfig, client: EngineClient) -> None:
        self.cfg = cfg
        self.client = client
        self.rendered_prompt_limit = cfg.rendered_prompt_limit
        self.readers = Readers()  # the bodies being read: ended with a 503 at SIGTERM

    async def read(self, route: Route, request: Request, arrival: float) -> Draft:
        data = await read_json(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s,
                               self.readers)
        body = route.parse(data) if route.parse else parse_body(route.schema, data)
        stream = bool(body.stream) if route.stream is None else route.stream
        address = request.client.host if request.client else ""
        return Draft(route, body, arrival, self.deadline(arrival, body.timeout), stream, address,
                     prompt_chars(body))

    def deadline(self, arrival: float, timeout: float | None) -> float | None:
        """A client's timeout, in full up to --max-timeout-s; none: --default-timeout-s, and
        without one no deadline at all (a request then waits its turn, however long)."""
        cfg = self.cfg
        if timeout is None:
            return arrival + cfg.default_timeout_s if cfg.default_timeout_s > 0 else None
        return arrival + (min(timeout, cfg.max_timeout_s) if cfg.max_timeout_s > 0 else timeout)

    async def prepare(self, draft: Draft, key: str | None) -> EngineRequest:
        if not draft.route.generates:
            return await self.prepare_embeddings(draft)
        cfg = self.cfg
        model = self.model(draft.body.model)
        body, tool_plan, chars, encode = self.prompt_of(draft.body, model.tokenizer)
        max_tokens, fields, stop = body.requested_max_tokens(), body.sampling(), body.stop_list()
        try:
            check_limits(chars, max_tokens, max_prompt_chars=cfg.max_prompt_chars,
                         max_tokens_cap=cfg.max_tokens_cap)
        except RequestLimitError as exc:
            raise APIError(422, str(exc), param=exc.param, code="invalid_value") from None
        # Structured output / tool grammar: a bad one is a 400 before anything is tokenized.
        grammar = await request_grammar(body, tool_plan.lark() if tool_plan else None,
                                        key or draft.address)
        try:
            # Keyed by model: a slow chat template holds at most 2 of the 3 threads. Every job
            # holds an admission ticket (reserved before this), so admission bounds the queue.
            ids = await offload.run("tokenize", encode, model.tokenizer, key=model.model_id)
        except ChatTemplateError as exc:
            raise APIError(400, f"chat template: {exc}", param="messages") from None
        except offload.Busy as exc:
            raise too_many_requests(str(exc), "server_busy", 1.0) from None
        if not ids:
            raise APIError(422, "the prompt has no tokens", param="prompt", code="invalid_value")
        keep = getattr(body, "truncate_prompt_tokens", None)
        if keep is not None:  # left truncation: the end of a prompt is what it asks
            ids = ids[-(model.hello.max_model_len if keep == -1 else keep):]
        vocab = model.tokenizer.vocab_size
        if max(ids) >= vocab:  # only a prompt sent as token ids can fail this
            raise APIError(400, f"prompt token ids must be below the vocabulary size ({vocab})",
                           param="prompt", code="invalid_token_ids")
        for param, listed in (("logit_bias", [t for t, _ in fields.get("logit_bias", ())]),
                              ("stop_token_ids", fields.get("stop_token_ids", ()))):
            if listed and max(listed) >= vocab:
                raise APIError(400, f"{param} token ids must be below the vocabulary size "
                               f"({vocab})", param=param, code="invalid_token_ids")
        params = self.sampling(model, len(ids), max_tokens, draft.route.default_max_tokens,
                               **fields)
        if params.min_tokens > params.max_tokens:
            raise APIError(400, f"min_tokens ({params.min_tokens}) exceeds max_tokens "
                           f"({params.max_tokens})", param="min_tokens", code="invalid_value")
        return EngineRequest(draft.route.name, body, draft.arrival, draft.deadline, draft.stream,
                             model, ids, params, stop, grammar, cache_salt(key, body.cache_salt),
                             tool_plan, getattr(body, "skip_special_tokens", True),
                             getattr(body, "include_stop_str_in_output", False),
                             reasoning_parser(cfg.reasoning_parser, draft.route.name, grammar))

    async def prepare_embeddings(self, draft: Draft) -> EngineRequest:
        """An embedding request's inputs as tokens, each checked against the model's context
        and vocabulary; the model must serve embeddings and a `dimensions` be its size (400)."""
        body: EmbeddingRequest = draft.body
        model = self.model(body.model)
        size = model.hello.embedding_size
        if not size:
            raise APIError(400, f"model {model.model_id!r} does not serve embeddings (its "
                           "worker computes none)", param="model", code="unsupported_model")
        if body.dimensions is not None and body.dimensions != size:
            raise APIError(400, f"model {model.model_id!r} gives vectors of {size} floats, which "
                           f"cannot be shortened to {body.dimensions}: leave dimensions out",
                           param="dimensions", code="unsupported_parameter")
        try:
            check_limits(draft.prompt_chars, None, max_prompt_chars=self.cfg.max_prompt_chars,
                         max_tokens_cap=self.cfg.max_tokens_cap)
        except RequestLimitError as exc:
            raise APIError(422, str(exc), param="input", code="invalid_value") from None
        inputs = body.inputs()
        if isinstance(inputs[0], str):
            texts: list[str] = inputs  # type: ignore[assignment]
            try:
                batch = await offload.run("tokenize", lambda tok: [tok.encode(t) for t in texts],
                                          model.tokenizer, key=model.model_id)
            except offload.Busy as exc:
                raise too_many_requests(str(exc), "server_busy", 1.0) from None
        else:
            batch = [list(ids) for ids in inputs]  # type: ignore[arg-type]
        context, vocab = model.hello.max_model_len, model.tokenizer.vocab_size
        for i, ids in enumerate(batch):
            if not ids:
                raise APIError(422, f"input {i} has no tokens", param="input",
                               code="invalid_value")
            if len(ids) > context:
                raise APIError(400, f"input {i} has {len(ids)} tokens, over the model's context "
                               f"of {context}", param="input", code="context_length_exceeded")
            if max(ids) >= vocab:
                raise APIError(400, f"token ids must be below the vocabulary size ({vocab})",
                               param="input", code="invalid_token_ids")
        params = m.SamplingParams(max_tokens=1, n=len(batch), speculative=False)
        return EngineRequest(draft.route.name, body, draft.arrival, draft.deadline, False, model,
                             [t for ids in batch for t in ids], params, [],
                             input_lengths=[len(ids) for ids in batch])

    def prompt_of(self, body: Any, tokenizer: GatewayTokenizer
                ) -> tuple[Any, ToolPlan | None, int, Encode]:
        """The body (a one-prompt batch unwrapped), a chat's tool plan, the prompt's length in
        characters, and how it becomes tokens."""
        if isinstance(body, ChatCompletionRequest):
            tool_plan = ToolPlan.from_request(body, tokenizer)
            tools = None
            if tokenizer.native_tools:  # the template renders tools, calls and results itself
                messages = template_messages(body.messages)
                tools = template_tools(body.tools) if tool_plan else None
                chars = sum(len(msg.text()) for msg in body.messages) + len(json.dumps(tools)
                                                                            if tools else "")
            else:  # calls and results become plain turns; tools go into the system message
                messages = render_messages(body.messages, body.tools if tool_plan else None)
                chars = sum(len(msg["content"]) for msg in messages)
            limit, timeout = self.rendered_prompt_limit, self.cfg.template_timeout_s
            # a client's template variables are its text too: counted, and (as all it sent)
            # never control tokens (encode_chat)
            chars += sum(len(text) for text in _strings(body.chat_template_kwargs))

            if body.continue_final_message and body.add_generation_prompt:
                raise APIError(400, "continue_final_message needs add_generation_prompt false",
                               param="continue_final_message", code="invalid_value")

            def chat(tok: GatewayTokenizer) -> list[int]:
                # max_prompt_chars counts the messages' text; the rendering is bounded too.
                return tok.encode_chat(
                    messages, body.add_generation_prompt, tools=tools, max_chars=limit,
                    timeout_s=timeout, extra=body.chat_template_kwargs,
                    continue_final_message=body.continue_final_message)

            return body, tool_plan, chars, chat
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch of one (the schema refuses more)
            body = body.model_copy(update={"prompt": prompt})
        suffix = getattr(body, "suffix", None)
        if suffix is not None:  # fill in the middle: the prompt is the code before the hole
            if tokenizer.fim_ids() is None:
                raise APIError(400, f"model {body.model or 'served'!r} has no fill-in-the-middle "
                               "tokens (such as <|fim_prefix|>): suffix is not supported",
                               param="suffix", code="unsupported_parameter")
            return (body, None, len(prompt) + len(suffix),
                    lambda tok: tok.encode_fim(prompt, suffix))
        if isinstance(prompt, str):
            return body, None, len(prompt), lambda tok: tok.encode(prompt)
        return body, None, len(prompt), lambda tok: list(prompt)

    def model(self, name: str | None) -> ModelEntry:
        """The model asked for by id or alias; absent: the first one served."""
        registry = self.client.registry
        if not registry.models:
            raise APIError(503, "no worker is ready yet", code="no_worker")
        if name is None or name == "":
            return next(iter(registry.models.values()))
        entry = registry.model(name)
        if entry is None:
            raise APIError(404, f"model {name!r} is not served here (served: "
                           f"{', '.join(registry.models)})", param="model",
                           code="model_not_found")
        return entry

    def sampling(self, model: ModelEntry, prompt_len: int, max_tokens: int | None,
                 default_max: int | None, **fields: Any) -> m.SamplingParams:
        """An absent max_tokens is the route's default (None: the rest of the context), within
        the cap and the context; an asked one must fit the context (400)."""
        room = model.hello.max_model_len - prompt_len
        if max_tokens is None:
            if room < 1:
                raise APIError(400, f"the prompt has {prompt_len} tokens, which leaves no room "
                               f"in the context of {model.hello.max_model_len}",
                               param="prompt", code="context_length_exceeded")
            max_tokens = min(room if default_max is None else default_max,
                             self.cfg.max_tokens_cap, room)
        elif prompt_len + max_tokens > model.hello.max_model_len:
            raise APIError(400, f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens})"
                           f" exceeds the model's context of {model.hello.max_model_len}",
                           param="max_tokens", code="context_length_exceeded")
        top_k = fields.pop("top_k", -1)
        return m.SamplingParams(max_tokens=max_tokens, top_k=max(0, top_k), **fields)


def reasoning_parser(parser: str, route: str, grammar: str | None) -> str:
    """The parser a chat's output goes through. A grammar holds the text from its first token,
    so a template's opened <think> is not continued: thinking only where the text itself opens
    it (qwen3's reading), never a whole constrained answer read as thinking."""
    if route != "chat" or not parser:
        return ""
    return "qwen3" if grammar is not None else parser


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value (keys and values, at any depth)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def prompt_chars(body: Any) -> int:
    """The characters of a body's prompt (a token-id prompt: its ids), cheaply: before it is
    tokenized, admission counts it as the prompt's tokens (most tokens span a character or
    more), and the exact count once it is tokenized."""
    if isinstance(body, ChatCompletionRequest):
        return sum(len(msg.text()) for msg in body.messages)
    if isinstance(body, EmbeddingRequest):
        return sum(len(x) for x in body.inputs())
    prompt = body.prompt
    suffix = len(getattr(body, "suffix", None) or "")  # fill in the middle: both sides count
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return sum(len(p) for p in prompt) + suffix
    return len(prompt) + suffix
