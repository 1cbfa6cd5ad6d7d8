"""Issue 42, end to end: a model that computes NaN gets each request a clear error, not a 500
with a traceback (its logprobs could not be written as JSON) nor garbage text (sampling from NaN
probabilities picked arbitrary tokens, greedy picked token 0).

The tiny random model, copied with its final norm's weights set to NaN, so that every logit is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.procs import GatewayProc, WorkerProc


def nan_copy(src: Path, out: Path) -> Path:
    shutil.copytree(src, out)
    weights = load_file(out / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("extra", [{"logprobs": 2}, {"temperature": 1.0}, {"temperature": 0},
                                   {"stream": True}], ids=["logprobs", "sampled", "greedy",
                                                           "streamed"])
def test_a_model_that_computes_nan_answers_each_request_with_a_clear_error(
        nan_server: tuple[GatewayProc, WorkerProc], extra: dict) -> None:
    gw, _ = nan_server
    resp = httpx.post(gw.base_url + "/v1/completions", timeout=60, json={
        "model": "tiny-nan", "prompt": "Hi", "max_tokens": 3, **extra})
    if extra.get("stream"):
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        error = events[-1]["error"]
    else:
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
    assert error["code"] == "model_numerics" and "NaN" in error["message"], error
    assert "Traceback" not in gw.output()


@pytest.fixture(scope="module")
def nan_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    model = nan_copy(tiny_model_dir, tmp_path_factory.mktemp("nan") / "tiny-nan")
    with GatewayProc() as gw, WorkerProc(model, gw.engine_address, "--threads", "1") as wk:
        gw.wait_ready()
        yield gw, wk
