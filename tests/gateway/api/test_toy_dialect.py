"""Issue 55: a dialect is declared once. A toy API, POST /toy/echo {"say": text} answered with
{"echo": the model's text}, errors as {"toy_error": message}, is one record (route, parser,
formatter, schema) handed to the app beside the served ones; from that record alone the app
mounts the route, intake reads its body, its formatter renders the answer and its errors, and
/openapi.json documents it. Served end to end through the real Starlette app in-process against
the fake engine next door (tests/gateway/fake_engine.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from gateway.api.app import create_app
from gateway.config import GatewayConfig
from gateway.dialects.record import Dialect, Endpoint
from gateway.dialects.served import DIALECTS
from gateway.http.errors import validated
from gateway.http.schemas import CompletionRequest
from gateway.output.formatters import Formatter
from gateway.prompt.intake import Route
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import messages as m
from tests.gateway.fake_engine import FakeEngine

ANSWER = " Paris."


class ToyRequest(BaseModel):
    """The toy's body: something to say, and at most this many tokens back."""

    model_config = ConfigDict(extra="forbid")
    say: str = Field(min_length=1, max_length=200)
    most: int = Field(default=8, ge=1, le=16)


def parse(data: Any) -> CompletionRequest:
    """The toy's body, validated in its own terms, as the completion request it asks for."""
    body = validated(ToyRequest, data)
    return validated(CompletionRequest, {"prompt": body.say, "max_tokens": body.most})


class ToyFormatter(Formatter):
    """The toy's answer and errors: its own shapes, never OpenAI's."""

    def response(self) -> dict[str, Any]:
        return {"echo": self.text(0), "tokens": self.gen.completion_tokens}

    @classmethod
    def error_shape(cls, status: int, message: str, param: str | None,
                    code: str | None) -> tuple[int, dict[str, Any]]:
        return status, {"toy_error": message}


TOY_ERROR = {"type": "object", "required": ["toy_error"],
             "properties": {"toy_error": {"type": "string"}}}
TOY = Dialect("toy", (
    Endpoint("/toy/echo", Route("toy_echo", ToyRequest, stream=False, parse=parse), ToyFormatter,
             "the toy's echo of the model"),
), error_schema=("ToyError", TOY_ERROR))


def served(info: m.TokenizerInfo, tok: GatewayTokenizer, dialects: tuple[Dialect, ...],
           *calls: tuple[str, str, dict[str, Any] | None]
           ) -> tuple[Any, FakeEngine, list[httpx.Response]]:
    app = create_app(GatewayConfig(), dialects=dialects)
    engine = FakeEngine(app.state.gateway.client, info, tok, tokens=tuple(tok.encode(ANSWER)),
                        finish_reason="stop")

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return [await http.request(method, path, json=body) for method, path, body in calls]

    return app, engine, asyncio.run(run())


def test_a_toy_dialect_added_by_one_record_is_served_and_documented(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    say = "What is the capital of France?"
    app, engine, [ok, bad, doc] = served(
        smollm2_info, smollm2, (*DIALECTS, TOY),
        ("POST", "/toy/echo", {"say": say, "most": 5}),
        ("POST", "/toy/echo", {"say": say, "most": 99}),  # beyond the toy's schema
        ("GET", "/openapi.json", None))
    # intake read it by the toy's parser; the engine was asked the completion it became
    assert ok.status_code == 200, ok.text
    [gen] = [msg for msg in engine.sent if isinstance(msg, m.Generate)]
    assert gen.prompt_token_ids == smollm2.encode(say) and gen.params.max_tokens == 5
    # the toy's formatter answered, in the toy's shape
    assert ok.json() == {"echo": ANSWER, "tokens": len(smollm2.encode(ANSWER))}
    assert bad.status_code == 422 and set(bad.json()) == {"toy_error"}, bad.text
    # its one exchange closed and was counted under the record's route name
    admission = app.state.gateway.admission
    assert admission.outstanding == 0 and admission.waiting == 0
    [family] = app.state.gateway.metrics.requests.collect()
    assert {(s.labels["route"], s.labels["status"]) for s in family.samples
            if s.name.endswith("_total") and s.value} == {("toy_echo", "200"),
                                                          ("toy_echo", "422")}
    # /openapi.json documents it from the same record: its schema, summary and error shape
    assert doc.status_code == 200
    body = doc.json()
    operation = body["paths"]["/toy/echo"]["post"]
    assert operation["summary"] == "the toy's echo of the model"
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ToyRequest"}
    assert "text/event-stream" not in operation["responses"]["200"]["content"]  # never streams
    assert operation["responses"]["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ToyError"}
    schemas = body["components"]["schemas"]
    assert schemas["ToyError"] == TOY_ERROR and set(schemas["ToyRequest"]["properties"]) == {
        "say", "most"}
    # the served dialects are untouched beside it
    assert {"/v1/chat/completions", "/v1/messages", "/api/chat"} <= set(body["paths"])


def test_without_its_record_the_toy_is_neither_served_nor_documented(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    _, engine, [missing, doc] = served(smollm2_info, smollm2, DIALECTS,
                                       ("POST", "/toy/echo", {"say": "hi"}),
                                       ("GET", "/openapi.json", None))
    assert missing.status_code == 404
    assert "/toy/echo" not in doc.json()["paths"]
    assert "ToyRequest" not in doc.json()["components"]["schemas"]
    assert not [msg for msg in engine.sent if isinstance(msg, m.Generate)]
