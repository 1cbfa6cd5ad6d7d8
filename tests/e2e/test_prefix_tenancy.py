"""Issue 23: no tenant can read another's prompts through the prefix cache. The real gateway
(keys alice and bob) and a tiny-model worker, through the official openai client.

Before: the cache was shared across keys and usage.prompt_tokens_details.cached_tokens reported
hits, so bob learnt which of his guesses alice's prompt contained (16 cached tokens for the right
one). Now each key is its own tenant; a request's own cache_salt splits further.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.procs import GatewayProc, WorkerProc

SECRET = ("The launch code is 7 3 9 1 and the vault opens at midnight on the third floor "
          "behind the painting of the lighthouse.")


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path) -> Iterator[GatewayProc]:
    with GatewayProc("--api-keys", "alice,bob") as gw, \
            WorkerProc(tiny_model_dir, gw.engine_address, "--threads", "1"):
        gw.wait_ready()
        yield gw


def cached(gw: GatewayProc, key: str, prompt: str, **extra: object) -> int:
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0)
    out = client.completions.create(model="tiny-llama-seed0", prompt=prompt, max_tokens=2,
                                    temperature=0, extra_body=extra or None)
    return out.usage.prompt_tokens_details.cached_tokens


def test_another_keys_prompt_is_never_a_cache_hit(gw: GatewayProc) -> None:
    assert cached(gw, "alice", SECRET) == 0
    assert cached(gw, "alice", SECRET) >= 16  # alice's own cache works
    assert cached(gw, "bob", SECRET) == 0  # bob's right guess tells him nothing
    assert cached(gw, "bob", SECRET + " More.") >= 16  # and bob's own cache works too


def test_a_request_salt_is_a_tenant_of_its_own(gw: GatewayProc) -> None:
    prompt = SECRET.replace("7 3 9 1", "4 4 2 0")
    assert cached(gw, "alice", prompt) == 0
    assert cached(gw, "alice", prompt, cache_salt="project-x") == 0
    assert cached(gw, "alice", prompt, cache_salt="project-x") >= 16
    assert cached(gw, "alice", prompt) >= 16
