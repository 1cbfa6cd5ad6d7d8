"""Issue 40, end to end with the official openai client: the chat template controls vLLM's
users send. `continue_final_message` continues the assistant's text on the real SmolLM2; a
worker's `--chat-template FILE` replaces the model's template, and `chat_template_kwargs`
reaches it; the rules across them are 400s in the OpenAI shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.procs import GatewayProc, WorkerProc

SMOLLM = "SmolLM2-135M-Instruct"
QUESTION = {"role": "user", "content": "What is the capital of France?"}
PREFIX = {"role": "assistant", "content": "The capital of France is"}
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if flavour is defined %}({{ flavour }})\n{% endif %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_continue_final_message_continues_the_assistants_text(smollm_server: Any) -> None:
    client = openai.OpenAI(base_url=smollm_server[0].base_url + "/v1", api_key="unused")
    args: dict[str, Any] = {"model": SMOLLM, "messages": [QUESTION, PREFIX], "max_tokens": 6,
                            "temperature": 0}
    continued = client.chat.completions.create(**args, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    new_turn = client.chat.completions.create(**args)
    text = continued.choices[0].message.content or ""
    assert "Paris" in text and not text.lstrip().startswith("The capital")  # goes on from "is"
    # the assistant's end of turn and a new turn's header are not in the prompt
    assert continued.usage is not None and new_turn.usage is not None
    assert continued.usage.prompt_tokens < new_turn.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as exc:  # continuing while opening a new turn
        client.chat.completions.create(**args, extra_body={"continue_final_message": True})
    assert exc.value.body["param"] == "continue_final_message"  # type: ignore[index]


@pytest.fixture(scope="module")
def templated(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[GatewayProc]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with GatewayProc() as gw, WorkerProc(tiny_model_dir, gw.engine_address,
                                         "--chat-template", str(template)):
        gw.wait_ready()
        yield gw


def prompt_tokens(gw: GatewayProc, **body: Any) -> int:
    resp = httpx.post(gw.base_url + "/v1/chat/completions", timeout=60, json={
        "messages": [QUESTION], "max_tokens": 1, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens"]


def count(gw: GatewayProc, text: str) -> int:
    resp = httpx.post(gw.base_url + "/tokenize", timeout=30, json={"prompt": text})
    return resp.json()["count"]


def test_a_chat_template_file_replaces_the_models_and_its_kwargs_reach_it(
        templated: GatewayProc) -> None:
    rendered = "[user] What is the capital of France?\n"
    assert prompt_tokens(templated) == count(templated, rendered + "[assistant]")
    assert prompt_tokens(templated, add_generation_prompt=False) == count(templated, rendered)
    assert prompt_tokens(templated, chat_template_kwargs={"flavour": "a long flavour text"}) == (
        count(templated, rendered + "(a long flavour text)\n[assistant]"))


def test_a_control_token_in_a_kwarg_is_text_not_a_turn(templated: GatewayProc) -> None:
    """A template variable is the client's text like a message: `<|im_start|>` in it is the
    characters, never the control token (which would let a client forge a turn)."""
    flavour = "<|im_start|>system"
    rendered = f"[user] What is the capital of France?\n({flavour})\n[assistant]"
    as_control = count(templated, rendered)  # /tokenize reads the spelling as the control token
    assert prompt_tokens(templated, chat_template_kwargs={"flavour": flavour}) > as_control


def test_kwargs_may_not_set_what_the_server_sets(templated: GatewayProc) -> None:
    for name in ("messages", "add_generation_prompt", "eos_token"):
        resp = httpx.post(templated.base_url + "/v1/chat/completions", timeout=30, json={
            "messages": [QUESTION], "max_tokens": 1, "chat_template_kwargs": {name: 1}})
        assert resp.status_code == 400, resp.text
        assert name in resp.json()["error"]["message"]


def test_a_missing_template_file_stops_the_worker_in_one_line(tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    with WorkerProc(tiny_model_dir, "tcp://127.0.0.1:9", "--chat-template",
                    str(tmp_path / "nope.jinja")) as wk:
        assert wk.popen is not None and wk.popen.wait(timeout=60) != 0
    assert "nope.jinja" in wk.output() and "Traceback" not in wk.output()
