"""`/tokenize` and `/detokenize`, in vLLM's shapes: the served model's tokenizer over HTTP;
and Anthropic's `/v1/messages/count_tokens`.

    POST /tokenize   {"model", "prompt" | "messages", "add_special_tokens"}
                     ──▶ {"tokens", "count", "max_model_len"} (+ "token_strs" when asked)
    POST /detokenize {"model", "tokens"} ──▶ {"prompt"}

A prompt is encoded as /v1/completions encodes it (add_special_tokens true by default: the bos a
model asks for); messages as /v1/chat/completions renders and encodes them (the chat template,
with the generation prompt; a control token typed in a message stays text). Same key, rate
limit, body limits and error shape as the generation routes; the tokenizing runs in the
gateway's tokenizing threads, never on the event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import offload
from gateway.dialects import anthropic
from gateway.http.body import read_json
from gateway.http.errors import APIError, too_many_requests, validated
from gateway.http.schemas import (
    ChatCompletionRequest,
    DetokenizeRequest,
    RequestBase,
    TokenizeRequest,
)
from gateway.tokens.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from gateway.engine.registry import ModelEntry
    from gateway.service import GatewayState

# /tokenize and /detokenize hold no admission ticket; this bounds how many of them are in the
# tokenizing threads' queue at once (beyond: 429 server_busy).
MAX_IN_FLIGHT = 16
_in_flight = [0]


async def _body(request: Request, schema: type[RequestBase]) -> tuple[GatewayState, Any]:
    state: GatewayState = request.app.state.gateway
    state.auth.guard(request)
    data = await read_json(request, state.cfg.max_body_bytes, state.cfg.body_timeout_s,
                           state.intake.readers)
    return state, validated(schema, data)


def _model(state: GatewayState, name: str | None) -> ModelEntry:
    """The model's entry for its tokenizer; with --models-dir, never a reason to load it."""
    pool = state.models_on_demand
    entry = pool.tokenizer_entry(name) if pool is not None else None
    return entry if entry is not None else state.intake.model(name)


async def tokenize(request: Request) -> Response:
    state, body = await _body(request, TokenizeRequest)
    entry = _model(state, body.model)
    tok, cfg = entry.tokenizer, state.cfg
    if body.prompt is not None:
        chars = len(body.prompt)
        special = True if body.add_special_tokens is None else body.add_special_tokens

        def encode(t: Any) -> list[int]:
            return t.encode(body.prompt, add_special_tokens=special)
    else:  # (add_special_tokens is ignored: the chat template writes its own)
        chat = ChatCompletionRequest(model=entry.model_id, messages=body.messages)
        _, _, chars, encode = state.intake.prompt_of(chat, tok)
    if chars > cfg.max_prompt_chars:
        raise APIError(422, f"the input is {chars} characters, over the server's limit of "
                       f"{cfg.max_prompt_chars}", param="prompt" if body.prompt else "messages",
                       code="invalid_value")
    try:
        ids = await _bounded(encode, tok, key=entry.model_id)
    except ChatTemplateError as exc:
        raise APIError(400, f"chat template: {exc}", param="messages") from None
    except offload.Busy as exc:
        raise too_many_requests(str(exc), "server_busy", 1.0) from None
    out: dict[str, Any] = {"tokens": ids, "count": len(ids),
                           "max_model_len": entry.hello.max_model_len}
    if body.return_token_strs:
        out["token_strs"] = [tok.decode([i], skip_special_tokens=False) for i in ids]
    return JSONResponse(out)


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens (Anthropic's): the prompt's tokens as /v1/messages renders
    it (system, messages and tools through the chat template), errors in Anthropic's shape."""
    try:
        state: GatewayState = request.app.state.gateway
        state.auth.guard(request)
        data = await read_json(request, state.cfg.max_body_bytes, state.cfg.body_timeout_s,
                               state.intake.readers)
        chat = anthropic.parse(anthropic.CountTokensRequest, data)
        entry = _model(state, chat.model)
        _, _, chars, encode = state.intake.prompt_of(chat, entry.tokenizer)
        if chars > state.cfg.max_prompt_chars:
            raise APIError(400, f"the input is {chars} characters, over the server's limit "
                           f"of {state.cfg.max_prompt_chars}", param="messages")
        try:
            ids = await _bounded(encode, entry.tokenizer, key=entry.model_id)
        except ChatTemplateError as exc:
            raise APIError(400, f"chat template: {exc}", param="messages") from None
        except offload.Busy as exc:
            raise too_many_requests(str(exc), "server_busy", 1.0) from None
    except APIError as exc:
        return JSONResponse(anthropic.error_body(exc.status, exc.message),
                            anthropic.error_status(exc.status), exc.headers)
    return JSONResponse({"input_tokens": len(ids)})


async def detokenize(request: Request) -> Response:
    state, body = await _body(request, DetokenizeRequest)
    entry = _model(state, body.model)
    vocab = entry.tokenizer.vocab_size
    if body.tokens and max(body.tokens) >= vocab:
        raise APIError(400, f"token ids must be below the vocabulary size ({vocab})",
                       param="tokens", code="invalid_token_ids")
    try:
        text = await _bounded(entry.tokenizer.decode, body.tokens, False, key=entry.model_id)
    except offload.Busy as exc:
        raise too_many_requests(str(exc), "server_busy", 1.0) from None
    return JSONResponse({"prompt": text})


async def _bounded(fn: Any, *args: Any, key: str) -> Any:
    if _in_flight[0] >= MAX_IN_FLIGHT:
        raise offload.Busy("tokenize", per_client=False)
    _in_flight[0] += 1
    try:
        return await offload.run("tokenize", fn, *args, key=key)
    finally:
        _in_flight[0] -= 1
