"""gateway/prompt/tools.py: the prompt formats (generic, and native through the model's template),
the grammars for each tool_choice, parsing of calls, and the streamed deltas. Grammars run on
SmolLM2's tokenizer through llguidance (with Qwen2.5's tags added where native)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from llguidance import LLMatcher, LLTokenizer
from tokenizers import AddedToken, Tokenizer

from gateway.http.errors import APIError
from gateway.http.schemas import ChatCompletionRequest
from gateway.prompt.structured import build_checked
from gateway.prompt.tool_calls import CLOSE, OPEN
from gateway.prompt.tools import ToolPlan, render_messages, template_messages, template_tools
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol.messages import TokenizerInfo

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def lltok(smollm2_info: TokenizerInfo) -> LLTokenizer:
    return LLTokenizer(smollm2_info.tokenizer_json, eos_token=smollm2_info.eos_token_ids)


def body(**fields: object) -> ChatCompletionRequest:
    msgs = fields.pop("messages", [{"role": "user", "content": "weather?"}])
    return ChatCompletionRequest.model_validate({"messages": msgs, "tools": TOOLS, **fields})


def accepts(lltok: LLTokenizer, plan: ToolPlan, text: str) -> bool:
    m = LLMatcher(lltok, build_checked("lark", plan.lark()), log_level=0)
    return m.consume_tokens(lltok.tokenize_str(text)) and m.is_accepting()


def test_tools_go_into_the_system_message_and_calls_and_results_render_as_text() -> None:
    b = body(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    out = render_messages(b.messages, b.tools)
    assert out[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": CALL}
    assert out[3] == {"role": "user", "content": "The result of get_weather: sunny"}
    assert render_messages(b.messages[1:2], b.tools)[0]["role"] == "system"  # inserted


def test_required_and_named_allow_exactly_one_valid_call(lltok: LLTokenizer) -> None:
    required = ToolPlan.from_request(body(tool_choice="required"))
    assert required is not None and accepts(lltok, required, CALL)
    assert not accepts(lltok, required, "Sure, let me check.")
    assert not accepts(lltok, required, CALL.replace("Paris", "Paris\",\"x\":\"1"))
    named = ToolPlan.from_request(body(tool_choice={"type": "function",
                                                    "function": {"name": "get_time"}}))
    assert named is not None and not accepts(lltok, named, CALL)
    assert accepts(lltok, named, '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>')


def test_arguments_get_no_unlisted_keys_unless_the_schema_allows_them(lltok: LLTokenizer) -> None:
    open_params = {"type": "object", "properties": {"city": {"type": "string"}}}
    loose = {"type": "object", "properties": {"city": {"type": "string"}},
             "additionalProperties": True}
    for params, extra_ok in ((open_params, False), (loose, True)):
        b = ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]})
        plan = ToolPlan.from_request(b)
        assert plan is not None
        extra = '<tool_call>\n{"name":"f","arguments":{"city":"a","x":1}}\n</tool_call>'
        assert accepts(lltok, plan, extra) is extra_ok


def test_auto_allows_free_text_or_a_constrained_call(lltok: LLTokenizer) -> None:
    auto = ToolPlan.from_request(body())
    assert auto is not None and auto.mode == "auto"
    assert accepts(lltok, auto, "It is sunny <b>today</b>.")
    assert accepts(lltok, auto, CALL)
    assert not accepts(lltok, auto, '<tool_call>\n{"name":"nope"')
    assert ToolPlan.from_request(body(tool_choice="none")) is None


def test_tool_choice_errors_are_400() -> None:
    for fields in ({"tool_choice": {"type": "function", "function": {"name": "missing"}}},):
        with pytest.raises(APIError) as info:
            ToolPlan.from_request(body(**fields))
        assert info.value.status == 400 and info.value.param == "tool_choice"
    no_tools = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})
    with pytest.raises(APIError):
        ToolPlan.from_request(no_tools)


def test_parse_gives_openai_tool_calls_or_leaves_text() -> None:
    plan = ToolPlan.from_request(body(tool_choice="required"))
    assert plan is not None
    message, finish = plan.message(CALL, "stop")
    assert finish == "tool_calls" and message["content"] is None
    call = message["tool_calls"][0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    truncated = CALL[:30]
    assert plan.message(truncated, "length") == ({"role": "assistant", "content": truncated},
                                                 "length")
    assert plan.message("plain words", "stop")[1] == "stop"


def test_stream_passes_text_through_and_sends_a_call_as_indexed_deltas() -> None:
    plan = ToolPlan.from_request(body())
    assert plan is not None
    text = plan.stream()
    assert text.feed("Hel", None) == ([{"content": "Hel"}], None)
    assert text.feed("lo", "stop") == ([{"content": "lo"}], "stop")
    call = plan.stream()
    assert call.feed("<tool", None) == ([], None)  # could still be a call: held back
    assert call.feed(CALL[5:40], None) == ([], None)
    deltas, finish = call.feed(CALL[40:], "stop")
    assert finish == "tool_calls"
    assert deltas[0]["tool_calls"][0]["index"] == 0
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(deltas[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


# ---- native: the model's own template lays out the tools (Qwen2.5's) --------------------------

QWEN = (Path(__file__).parents[2] / "data" / "qwen2.5_chat_template.jinja").read_text("utf-8")
SPACED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwenish(smollm2_info: TokenizerInfo) -> TokenizerInfo:
    """SmolLM2's vocabulary plus Qwen2.5's two tags as added (not special) tokens, and Qwen2.5's
    chat template: what gateway.prompt.tools meets in a Qwen2.5 model."""
    tok = Tokenizer.from_str(smollm2_info.tokenizer_json)
    tok.add_tokens([AddedToken(OPEN, special=False), AddedToken(CLOSE, special=False)])
    return dataclasses.replace(smollm2_info, tokenizer_json=tok.to_str(), chat_template=QWEN)


@pytest.fixture(scope="module")
def qwen_lltok(qwenish: TokenizerInfo) -> LLTokenizer:
    return LLTokenizer(qwenish.tokenizer_json, eos_token=qwenish.eos_token_ids)


def native_plan(qwenish: TokenizerInfo, **fields: object) -> ToolPlan:
    plan = ToolPlan.from_request(body(**fields), GatewayTokenizer(qwenish))
    assert plan is not None and plan.native
    return plan


def test_native_calls_are_written_as_the_template_shows_them(
        qwen_lltok: LLTokenizer, qwenish: TokenizerInfo) -> None:
    lltok = qwen_lltok
    required = native_plan(qwenish, tool_choice="required")
    assert accepts(lltok, required, SPACED)
    assert not accepts(lltok, required, CALL)  # compact: not how the template writes calls
    assert accepts(lltok, required, SPACED + "\n" + TIME)  # "one or more functions"
    auto = native_plan(qwenish)
    assert accepts(lltok, auto, "It is sunny.") and accepts(lltok, auto, SPACED + "\n" + TIME)
    single = native_plan(qwenish, tool_choice="required", parallel_tool_calls=False)
    assert accepts(lltok, single, SPACED) and not accepts(lltok, single, SPACED + "\n" + TIME)
    named = native_plan(qwenish, tool_choice={"type": "function",
                                              "function": {"name": "get_time"}})
    assert accepts(lltok, named, TIME) and not accepts(lltok, named, TIME + "\n" + TIME)


def test_native_grammar_takes_the_tags_as_their_added_tokens(
        qwen_lltok: LLTokenizer, lltok: LLTokenizer, qwenish: TokenizerInfo) -> None:
    spelled = lltok.tokenize_str(SPACED)  # SmolLM2's own pieces: "<", "tool", "_", ...
    lltok = qwen_lltok
    gw = GatewayTokenizer(qwenish)
    open_id, close_id = gw.added_token_id(OPEN), gw.added_token_id(CLOSE)
    assert open_id is not None and close_id is not None
    plan = native_plan(qwenish, tool_choice="required")
    inner = lltok.tokenize_str('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n')
    assert open_id not in spelled and lltok.tokenize_str(SPACED) == [open_id, *inner, close_id]
    for ids in ([open_id, *inner, close_id], spelled):  # as one token each, or spelled out
        m = LLMatcher(lltok, build_checked("lark", plan.lark()), log_level=0)
        assert m.consume_tokens(ids) and m.is_accepting(), m.get_error()
    generic = ToolPlan.from_request(body(tool_choice="required"), GatewayTokenizer(
        dataclasses.replace(qwenish, chat_template=None)))
    assert generic is not None and not generic.native and f"<[{open_id}]>" in generic.lark()


def test_template_messages_carry_calls_as_mappings_and_tools_as_sent() -> None:
    b = body(messages=[
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant"}],
        tools=[{"type": "function", "function": {"name": "f", "strict": True,
                                                 "parameters": WEATHER}}])
    out = template_messages(b.messages)
    assert out[0] == {"role": "user", "content": [{"type": "text", "text": "weather?"}]}
    assert out[1] == {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert out[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert out[3] == {"role": "assistant", "content": ""}
    assert template_tools(b.tools) == [{"type": "function", "function": {
        "name": "f", "parameters": WEATHER}}]
