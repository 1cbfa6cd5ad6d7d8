"""The one content check the end-to-end tests make on the real SmolLM2: it names Paris.

Asked plainly ("What is the capital of France?") the model's first token is a near tie ('The'
against 'L', 0.02-0.08 nats on the hosts we measured), so the answer flips with the CPU's
rounding: an AVX2 host answers "L'Étoile..." (and so does llama.cpp's server there). Asked for one
word, every token up to "Paris" wins by 1.8 nats or more on the float32, INT8, INT4 and
GGUF-native paths. The check still reads only the decisive prefix (tests/numerics.py), so a host
that found a near tie there fails with the gaps in its message, not with a different answer.
"""

from __future__ import annotations

from typing import Any

import openai

from tests.numerics import MARGIN, decisive_chat_text, decisive_completion_text

QUESTION = "What is the capital of France? Answer with one word."
CHAT = [{"role": "user", "content": QUESTION}]
# The same question as a raw completion prompt in SmolLM2's chat format.
PROMPT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def assert_chat_names_paris(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    """A greedy chat answer whose decisive prefix names Paris; returns the response."""
    answer = client.chat.completions.create(model=model, temperature=0, max_tokens=30,
                                            messages=CHAT, logprobs=True, top_logprobs=2,
                                            **kwargs)
    decisive = decisive_chat_text(answer.choices[0])
    assert "Paris" in decisive, (f"no Paris before the first token won by < {MARGIN} nats: "
                                 f"{decisive!r} of {answer.choices[0].message.content!r}")
    return answer


def assert_completion_names_paris(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    answer = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=30,
                                       logprobs=2, **kwargs)
    decisive = decisive_completion_text(answer.choices[0])
    assert "Paris" in decisive, (f"no Paris before the first token won by < {MARGIN} nats: "
                                 f"{decisive!r} of {answer.choices[0].text!r}")
    return answer
