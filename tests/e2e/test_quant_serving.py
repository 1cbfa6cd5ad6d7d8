"""INT8 and INT4 SmolLM2 served through the API still answer the Paris question."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.capital import assert_chat_names_paris
from tests.procs import GatewayProc, WorkerProc

pytestmark = pytest.mark.smollm


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_smollm2_answers_paris(smollm2_dir: Path, mode: str) -> None:
    with GatewayProc() as gw, WorkerProc(smollm2_dir, gw.engine_address, "--model-id", "smol",
                                         "--quantization", mode):
        gw.wait_ready(timeout=180)
        model = httpx.get(gw.base_url + "/v1/models").json()["data"][0]
        assert model["quantization"] == mode and 0 < model["weight_bytes"] < 400e6
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)
        assert_chat_names_paris(client, "smol")
