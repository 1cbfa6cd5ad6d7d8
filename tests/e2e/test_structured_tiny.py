"""Structured output end to end on the tiny random Llama: real gateway and worker processes,
real ZeroMQ, the official openai client. A random model is the hard case for a grammar: left
alone it never writes JSON, so every valid answer here is the mask's doing."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

# Enums, nested objects, arrays and required fields; bounded so that a random model ends
# within max_tokens (strings and arrays have maximum lengths, integers a range).
SCHEMA = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["active", "inactive", "pending"]},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "role": {"enum": ["admin", "user"]},
            },
            "required": ["name", "age", "role"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 1, "maxItems": 3},
        "flag": {"type": "boolean"},
    },
    "required": ["status", "owner", "tags", "scores", "flag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:  # noqa: ANN001
    gw, _ = tiny_server
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)


def test_schema_with_enums_nesting_arrays_is_valid_json_in_100_seeded_runs_at_temperature_1(
        client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA,
                                                  "strict": True}}

    def one(seed: int) -> tuple[str, str]:
        out = client.chat.completions.create(
            model="tiny-llama-seed0", messages=[{"role": "user", "content": f"record {seed}"}],
            temperature=1.0, seed=seed, max_tokens=120, response_format=fmt)
        return out.choices[0].message.content or "", out.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(100)))
    texts = set()
    for text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not re.search(r"\s", outside_strings), text  # compact: no whitespace between
        texts.add(text)
    assert len(texts) > 50  # seeded sampling at temperature 1, not one forced answer


def test_streamed_constrained_answer_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny-llama-seed0", messages=[{"role": "user", "content": "x"}],
                  temperature=1.0, seed=7, max_tokens=120,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "r", "schema": SCHEMA}})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == full
    jsonschema.validate(json.loads(full), SCHEMA)


def test_vllm_guided_choice_regex_and_json_object(client: openai.OpenAI) -> None:
    def chat(**extra: object) -> str:
        out = client.chat.completions.create(
            model="tiny-llama-seed0", messages=[{"role": "user", "content": "pick"}],
            temperature=1.0, seed=3, max_tokens=60, **extra)
        return out.choices[0].message.content or ""

    assert chat(extra_body={"guided_choice": ["alpha", "beta", "gamma"]}) in \
        {"alpha", "beta", "gamma"}
    regex = r"[0-9]{3}-[a-z]{2}"
    assert re.fullmatch(regex, chat(extra_body={"guided_regex": regex}))
    assert chat(extra_body={"structured_outputs": {"choice": ["yes", "no"]}}) in {"yes", "no"}
    grammar = 'start: "x" ("y" | "z")'
    assert chat(extra_body={"guided_grammar": grammar}) in {"xy", "xz"}
    gbnf = 'root ::= "n" [0-9] [0-9]'
    assert re.fullmatch(r"n[0-9]{2}", chat(extra_body={"guided_grammar": gbnf}))
    small = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"],
             "additionalProperties": False}
    assert json.loads(chat(extra_body={"guided_json": small}))["k"] in (1, 2)


def test_completions_route_takes_guided_regex(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny-llama-seed0", prompt="The year:", max_tokens=10,
                                    extra_body={"guided_regex": r"(19|20)[0-9]{2}"}, seed=1)
    assert re.fullmatch(r"(19|20)[0-9]{2}", out.choices[0].text)
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
])
def test_bad_constraint_is_400_at_once_and_nothing_leaks(tiny_server, extra, param) -> None:  # noqa: ANN001
    gw, _ = tiny_server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    r = httpx.post(gw.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "Traceback" not in r.text
    metrics = httpx.get(gw.base_url + "/metrics", timeout=10).text
    assert re.search(r"^kestrel_requests_in_flight(\{[^}]*\})? 0\.0$", metrics, re.M), \
        [m for m in metrics.splitlines() if "in_flight" in m]


def test_the_first_grammar_announces_the_workers_silence_once_and_it_stays(
        tiny_server, client: openai.OpenAI) -> None:  # noqa: ANN001
    """llguidance builds its tokenizer on the worker's first grammar holding the GIL, so the
    worker's heartbeats stop meanwhile: it says so first, over the real link, and the gateway
    logs it once (a gateway that did not know dropped a worker mid-request for that silence).
    The worker stays the one serving."""
    gw, wk = tiny_server
    fmt = {"type": "json_object"}
    for seed in range(2):
        client.chat.completions.create(
            model="tiny-llama-seed0", messages=[{"role": "user", "content": "json"}],
            seed=seed, max_tokens=8, response_format=fmt)
    said = [e for e in gw.log_lines() if "may be silent" in e.get("msg", "")]
    assert len(said) == 1 and "may be silent for up to 10.0 s" in said[0]["msg"], said
    assert not [e for e in gw.log_lines() if "lost" in e.get("msg", "")]
    assert wk.popen.poll() is None
