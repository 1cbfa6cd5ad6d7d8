"""The embedded GGUF served natively (`--model default`, --dtype auto) through the real gateway
and worker: its Q4_1/Q8_0 blocks packed, 4x smaller than float32, still answering Paris; its
matmul plan logged once and shown by /health; and served with an 8-bit KV cache."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.capital import assert_chat_names_paris
from tests.procs import GatewayProc, WorkerProc

pytestmark = pytest.mark.smollm


def test_default_gguf_served_natively_answers_paris(cache_dir: Path) -> None:
    with GatewayProc() as gw, WorkerProc("default", gw.engine_address, "--model-id", "smol",
                                         "--cache-dir", str(cache_dir),
                                         # one thread: many small packed-kernel calls a step
                                         # each end in an OpenMP barrier, which a CPU shared
                                         # with other test processes makes very slow
                                         "--threads", "1",
                                         # the packed blocks alone: a copy for many rows
                                         # is the host's choice (engine_worker/path_choice)
                                         "--dense-min-rows", "0") as wk:
        gw.wait_ready(timeout=180)
        model = httpx.get(gw.base_url + "/v1/models").json()["data"][0]
        # float32 SmolLM2 is 538 MB; its Q4_1/Q8_0 blocks served packed ~98 MB
        assert model["quantization"] == "gguf" and 0 < model["weight_bytes"] < 135e6
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)
        assert_chat_names_paris(client, "smol")
        assert "gguf-native weights loaded" in wk.output()  # progress was reported
        # which kernel each matmul runs: logged once at start, and shown by /health
        plans = [line for line in wk.output().splitlines() if "matmul plan:" in line]
        assert len(plans) == 1, plans
        [worker] = httpx.get(gw.base_url + "/health").json()["workers"]
        shown = worker["matmul_plan"]
        assert shown.startswith("matmul plan: ") and "head q8_0: " in shown, shown
        assert shown in plans[0] and shown.endswith("(flags)")  # --dense-min-rows: no measuring
        # what one decode step reads (issue 53): logged at start and shown by /health, no more
        # than the blocks held (a one-row step reads one row of the embedding table), the KV
        # cache in bfloat16 by default: 2 (K, V) x 30 layers x 3 KV heads x 64 x 2 bytes a token
        assert worker["kv_cache_dtype"] == "bfloat16"
        assert worker["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
        assert 0 < worker["decode_read_mb"] * 1e6 <= model["weight_bytes"] + 1e5, worker
        reads = [line for line in wk.output().splitlines() if "a decode step reads" in line]
        assert len(reads) == 1 and f"{worker['decode_read_mb']:.1f} MB" in reads[0], reads


def test_default_gguf_with_an_int8_kv_cache_answers_paris(cache_dir: Path) -> None:
    """Issue 53: --kv-cache-dtype int8, end to end: the worker writes and reads one-byte codes
    with a float16 scale per 32 values, and still answers; /health shows the cache's bytes."""
    with GatewayProc() as gw, WorkerProc("default", gw.engine_address, "--model-id", "smol",
                                         "--cache-dir", str(cache_dir), "--threads", "1",
                                         "--dense-min-rows", "0",
                                         "--kv-cache-dtype", "int8"):
        gw.wait_ready(timeout=180)
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)
        assert_chat_names_paris(client, "smol")
        [worker] = httpx.get(gw.base_url + "/health").json()["workers"]
        assert worker["kv_cache_dtype"] == "int8"
        # 2 (K, V) x 30 layers x 3 KV heads x (64 codes + 2 float16 scales' 4 bytes)
        assert worker["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 4)
