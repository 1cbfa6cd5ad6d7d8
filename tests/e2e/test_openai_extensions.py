"""Issue 40, end to end on the real SmolLM2 through the official openai client: vLLM's
extensions that shape the returned text."""

from __future__ import annotations

from typing import Any

import openai

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def test_include_stop_str_in_output_keeps_the_stop_string(smollm_server: Any) -> None:
    gw, _ = smollm_server
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused")

    def complete(**extra: Any) -> Any:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                         temperature=0, **extra).choices[0]

    free = complete().text
    words = free.split()
    assert len(words) >= 4, free
    stop = " " + words[2]  # a stop string the greedy text reaches mid-way
    cut = complete(stop=[stop])
    kept = complete(stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert cut.text == free[:free.index(stop)]
    assert kept.text == free[:free.index(stop) + len(stop)]
