"""Issue 39, end to end: a K-quant GGUF's second start maps the blocks its first start wrote
and begins from its step-cost probe, then answers as the first start did. On the real
Qwen2.5-Coder-0.5B Q4_K_M (skipped where the file is not in the cache's gguf/ folder:
`python benchmarks/fetch_qwen_gguf.py --only 0.5b`), each start in a fresh cache dir of its
own test, through the real gateway and worker. The cache dir starts with the file's converted
tokenizer and config (made once per host, as a server's cache keeps them: 11 s of the 0.5B's
151k-token vocabulary), never with its blocks or its probe."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from engine_worker.model.loader import resolve_checkpoint
from tests.conftest import QWEN_GGUF
from tests.procs import GatewayProc, WorkerProc

PROMPT = "def fibonacci(n):"


def start_and_complete(cache: Path) -> tuple[float, str, str]:
    """Seconds to ready, the greedy completion, the worker's log."""
    with GatewayProc() as gw:
        started = time.monotonic()
        with WorkerProc(QWEN_GGUF, gw.engine_address, "--cache-dir", str(cache), "--threads",
                        "1", "--model-id", "qwen") as wk:
            gw.wait_ready(timeout=300)
            ready = time.monotonic() - started
            out = httpx.post(gw.base_url + "/v1/completions", json={
                "model": "qwen", "prompt": PROMPT, "max_tokens": 24, "temperature": 0},
                timeout=120).json()
            return ready, out["choices"][0]["text"], wk.output()


def test_a_second_start_maps_the_blocks_the_first_wrote_and_its_probe_and_answers_the_same(
        new_cache_dir: Callable[[], Path], cache_dir: Path) -> None:
    if not QWEN_GGUF.is_file():
        pytest.skip(f"{QWEN_GGUF} is not there")
    cache = new_cache_dir()
    meta = resolve_checkpoint(str(QWEN_GGUF), cache_dir, weights=False)  # once per host
    shutil.copytree(meta, cache / meta.name, ignore=shutil.ignore_patterns("blocks-v*"))
    cold, first, log1 = start_and_complete(cache)
    warm, second, log2 = start_and_complete(cache)
    # What the first start wrote to the block cache (tensors rewritten to another format, and
    # layers packed for the kernel; the 0.5B's Q4_K/Q6_K are served as stored, so its rewrites
    # may be none), the second maps whole, writing nothing.
    found = re.search(r"(\d+) tensors from the block cache, (\d+) written to it; (\d+) packed "
                      r"layers mapped, (\d+) written", log1)
    assert found is not None, log1
    hits, writes, packed_hits, packed_writes = (int(v) for v in found.groups())
    assert hits == 0 and packed_hits == 0 and packed_writes > 0
    assert "step costs measured" in log1
    assert f"{writes} tensors from the block cache, 0 written to it; {packed_writes} packed " \
        "layers mapped, 0 written" in log2
    assert "step costs from this host's earlier probe" in log2
    assert "step costs measured" not in log2
    assert second == first and first
    print(f"ready after {cold:.1f} s cold, {warm:.1f} s warm")
