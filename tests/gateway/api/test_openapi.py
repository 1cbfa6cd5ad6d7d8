"""gateway/api/openapi.py: /openapi.json says what the routes enforce (issue 23). The request
schemas' bounds, the rules across fields (gateway/http/request_rules.py) and the running server's
figures (served model names, vocabulary, context, configured limits), checked against the intake
itself with one fake worker: a body the document refuses, the route refuses; one it admits, the
route serves (for what a schema can say: not a grammar that does not compile, nor a prompt's token
count). With an on-demand pool (`kestrel serve --models-dir`) the document describes POST
/models/load and /models/unload too, and only then: without one they answer 404."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator

from gateway.api.app import create_app
from gateway.api.openapi import OpenAPIDocument, server_figures
from gateway.config import GatewayConfig
from gateway.engine.engine_client import EngineClient
from gateway.http.errors import APIError
from gateway.prompt.intake import Intake
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import messages as m
from tests.gateway.engine.test_on_demand import FakeSpawner
from tests.gateway.fake_engine import ROUTES, FakeEngine
from tests.gateway.prompt.test_intake import http_request

CFG = GatewayConfig(max_prompt_chars=1000, max_tokens_cap=100, default_timeout_s=20)
CONTEXT = 200
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
MODELS = {"completions": "CompletionRequest", "chat": "ChatCompletionRequest",
          "generate": "GenerateRequest", "responses": "ResponsesRequest"}
FUNCTION = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"][
    "parameters"]}]
JSON = {"format": {"type": "json_object"}}


@pytest.fixture
def served(smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> Any:
    client = EngineClient("inproc://unused")
    FakeEngine(client, smollm2_info, smollm2, model_id="tiny", max_model_len=CONTEXT)
    yield client, Intake(CFG, client)
    client.link.close()


def document(client: EngineClient) -> dict[str, Any]:
    return json.loads(OpenAPIDocument().render(server_figures(CFG, client.registry)))


def validator(doc: dict[str, Any], model: str) -> Draft202012Validator:
    text = json.dumps(doc["components"]["schemas"]).replace("#/components/schemas/", "#/$defs/")
    defs = json.loads(text)
    return Draft202012Validator({**defs[model], "$defs": defs})


def route_accepts(intake: Intake, route: str, body: dict[str, Any]) -> bool:
    async def go() -> None:
        draft = await intake.read(ROUTES[route], http_request(body), time.monotonic())
        await intake.prepare(draft, None)

    try:
        asyncio.run(go())
    except APIError:
        return False
    return True


def test_the_document_carries_the_served_models_figures(served: Any,
                                                        smollm2: GatewayTokenizer) -> None:
    client, _ = served
    doc = document(client)
    assert doc["openapi"] == "3.1.0" and "x-server-bound" not in json.dumps(doc)
    for schema in doc["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["model"]["enum"] == [None, "", "tiny"]
    text, batch, ids = completion["prompt"]["anyOf"]
    assert text["maxLength"] == batch["items"]["maxLength"] == CFG.max_prompt_chars
    assert ids["maxItems"] == CONTEXT - 1  # a prompt of ids must leave one token of room
    assert ids["items"]["exclusiveMaximum"] == smollm2.vocab_size
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == CFG.max_tokens_cap
    generate = doc["components"]["schemas"]["GenerateRequest"]["properties"]
    assert generate["max_new_tokens"]["anyOf"][0]["maximum"] == CFG.max_tokens_cap


def test_without_a_model_the_document_names_none_and_keeps_the_configured_limits() -> None:
    client = EngineClient("inproc://unused")
    try:
        doc = document(client)
    finally:
        client.link.close()
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "enum" not in completion["model"]
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == CFG.max_tokens_cap
    assert completion["prompt"]["anyOf"][2]["items"]["exclusiveMaximum"] == 2**32


OK, REFUSED = True, False


@pytest.mark.parametrize(("route", "body", "valid"), [
    ("completions", {"prompt": "hi"}, OK),
    ("completions", {"prompt": ""}, REFUSED),
    ("completions", {"prompt": []}, REFUSED),
    ("completions", {"prompt": ["a"]}, OK),
    ("completions", {"prompt": ["a", "b"]}, REFUSED),
    ("completions", {"prompt": [1, 2]}, OK),
    ("completions", {"prompt": [1, 10**9]}, REFUSED),
    ("completions", {"prompt": [1] * CONTEXT}, REFUSED),
    ("completions", {"prompt": "x" * 1001}, REFUSED),
    ("completions", {"prompt": "hi", "max_tokens": 100}, OK),
    ("completions", {"prompt": "hi", "max_tokens": 101}, REFUSED),
    ("completions", {"prompt": "hi", "max_tokens": 5.0, "n": 2.0}, OK),
    ("completions", {"prompt": "hi", "model": "tiny"}, OK),
    ("completions", {"prompt": "hi", "model": ""}, OK),
    ("completions", {"prompt": "hi", "model": "nope"}, REFUSED),
    ("completions", {"prompt": "hi", "stop": ["a"] * 5}, REFUSED),
    ("completions", {"prompt": "hi", "stop": ""}, REFUSED),
    ("completions", {"prompt": "hi", "logit_bias": {}}, OK),
    ("completions", {"prompt": "hi", "logit_bias": {"1": 1.0}}, OK),
    ("completions", {"prompt": "hi", "logit_bias": {"1": -100.5}}, REFUSED),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1.0}}, REFUSED),
    ("completions", {"prompt": "hi", "min_p": 0.5, "repetition_penalty": 1.2, "min_tokens": 2,
                     "stop_token_ids": [3]}, OK),
    ("completions", {"prompt": "hi", "min_p": -0.1}, REFUSED),
    ("completions", {"prompt": "hi", "stop_token_ids": [-1]}, REFUSED),
    ("completions", {"prompt": "hi", "guided_choice": ["a", "b"]}, OK),
    ("completions", {"prompt": "hi", "guided_choice": []}, REFUSED),
    ("completions", {"prompt": "hi", "guided_regex": "a+", "guided_choice": ["a"]}, REFUSED),
    ("completions", {"prompt": "hi", "guided_regex": "a+", "ignore_eos": True}, REFUSED),
    ("completions", {"prompt": "hi", "guided_regex": "a+", "response_format": {"type": "text"}},
     OK),
    ("completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}, REFUSED),
    ("completions", {"prompt": "hi", "structured_outputs": {"json_object": True}}, OK),
    ("completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     REFUSED),
    ("chat", {"messages": CHAT}, OK),
    ("chat", {"messages": [{"role": "user", "content": ""}]}, REFUSED),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     REFUSED),
    ("chat", {"messages": [{"role": "user", "content": ""}], "tools": TOOLS}, OK),
    ("chat", {"messages": CHAT, "tool_choice": "required"}, REFUSED),
    ("chat", {"messages": CHAT, "tool_choice": "none"}, OK),
    ("chat", {"messages": CHAT, "tools": TOOLS, "guided_regex": "a"}, REFUSED),
    ("chat", {"messages": CHAT, "tools": TOOLS, "tool_choice": "none", "guided_regex": "a"}, OK),
    ("responses", {"input": "hi"}, OK),
    ("responses", {"input": ""}, REFUSED),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": ""}]}]},
     REFUSED),
    ("responses", {"input": "hi", "max_output_tokens": 101}, REFUSED),
    ("responses", {"input": "hi", "tool_choice": "required"}, REFUSED),
    ("responses", {"input": "hi", "tool_choice": "auto"}, OK),
    ("responses", {"input": "hi", "tools": FUNCTION, "text": JSON}, REFUSED),
    ("responses", {"input": "hi", "tools": FUNCTION, "tool_choice": "none", "text": JSON}, OK),
    ("responses", {"input": "hi", "previous_response_id": "resp_1"}, REFUSED),
    ("responses", {"input": "hi", "store": True}, OK),
    ("generate", {"prompt": "hi", "max_new_tokens": 3}, OK),
    ("generate", {"prompt": ""}, REFUSED),
    ("generate", {"prompt": "hi", "max_new_tokens": 101}, REFUSED),
])
def test_the_document_and_the_route_agree(served: Any, route: str, body: dict[str, Any],
                                          valid: bool) -> None:
    client, intake = served
    doc = document(client)
    errors = [e.message for e in validator(doc, MODELS[route]).iter_errors(body)]
    assert (not errors) == valid, errors
    assert route_accepts(intake, route, body) == valid


MODEL_ROUTES = ("/models/load", "/models/unload")


def app_calls(spawner: FakeSpawner | None, *calls: tuple[str, str, Any]) -> list[httpx.Response]:
    """The real app in-process (no worker joins), asked `calls`: (method, path, JSON body)."""
    app = create_app(GatewayConfig(), spawner)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return [await http.request(method, path, json=body) for method, path, body in calls]

    try:
        return asyncio.run(run())
    finally:
        app.state.gateway.client.link.close()


def test_without_a_models_dir_the_load_routes_are_not_in_the_document() -> None:
    doc, *answers = app_calls(None, ("GET", "/openapi.json", None),
                              *(("POST", path, {"model": "a"}) for path in MODEL_ROUTES))
    assert not set(MODEL_ROUTES) & set(doc.json()["paths"])
    assert "ModelRequest" not in doc.json()["components"]["schemas"]
    assert [a.status_code for a in answers] == [404, 404]  # what the document's silence says


def test_with_an_on_demand_pool_the_document_describes_load_and_unload() -> None:
    [resp] = app_calls(FakeSpawner(["a", "b"]), ("GET", "/openapi.json", None))
    doc = resp.json()
    schemas = doc["components"]["schemas"]
    for schema in schemas.values():
        Draft202012Validator.check_schema(schema)
    for path in MODEL_ROUTES:
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = schemas[ref.rsplit("/", 1)[-1]]
        assert body["required"] == ["model"] and body["properties"]["model"]["type"] == "string"
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert schemas[ok.rsplit("/", 1)[-1]]["required"] == ["model", "status"]
        assert {"401", "404", "422", "429", "503"} <= set(op["responses"])
        for code, answer in op["responses"].items():
            if code != "200":
                assert answer["content"]["application/json"]["schema"]["$ref"].endswith(
                    "/Error")
    assert "409" in doc["paths"]["/models/unload"]["post"]["responses"]
    assert "409" not in doc["paths"]["/models/load"]["post"]["responses"]


@pytest.mark.parametrize(("body", "valid"), [
    ({"model": "a"}, OK),
    ({"model": "a", "other": 1}, OK),  # unknown fields are ignored, as on every route
    ({"model": ""}, REFUSED),
    ({"model": 1}, REFUSED),
    ({"model": None}, REFUSED),
    ({}, REFUSED),
    (["a"], REFUSED),
])
def test_the_document_and_the_unload_route_agree(body: Any, valid: bool) -> None:
    spawner = FakeSpawner(["a"])
    doc, answer = app_calls(spawner, ("GET", "/openapi.json", None),
                            ("POST", "/models/unload", body))
    schemas = doc.json()["components"]["schemas"]
    errors = [e.message for e in validator(doc.json(), "ModelRequest").iter_errors(body)]
    assert (not errors) == valid, errors
    assert answer.status_code == (200 if valid else 422), answer.text
    assert str(answer.status_code) in doc.json()["paths"]["/models/unload"]["post"]["responses"]
    shape = schemas["ModelStatus"] if valid else schemas["Error"]
    Draft202012Validator(shape).validate(answer.json())
