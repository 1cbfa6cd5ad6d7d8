"""Fixtures for the model, KV cache and model runner tests. All session-scoped: loading weights
is the slow part, and every test uses its own block ids, so sharing a runner is safe.

`smollm2_dir` (the converted SmolLM2, cached under KESTREL_CACHE_DIR or ~/.cache/kestrel) comes
from tests/conftest.py. The tiny model here lives in a temp folder and takes its tokenizer from
the embedded GGUF (the run's `smollm2_meta_dir`: config and tokenizer, no weights), so tests that
skip SmolLM2 (`-m "not smollm"`) never convert its weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_worker.model.tiny import make_tiny_checkpoint
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig

KV_BUDGET = 64 << 20  # bytes: 64 MiB is >1000 tokens even for SmolLM2 in float32


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_meta_dir: Path) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), seed=0,
                                tokenizer_from=smollm2_meta_dir)


@pytest.fixture(scope="session")
def tiny_runner(tiny_dir: Path) -> ModelRunner:
    # a float32 cache: the tests of this runner compare cached steps with a recomputation
    # without a cache, float32 throughout (the default bfloat16 cache has tests of its own)
    return ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=KV_BUDGET, block_size=16,
                                    kv_cache_dtype="float32"))


@pytest.fixture(scope="session")
def smollm2_runner(smollm2_dir: Path) -> ModelRunner:
    return ModelRunner(RunnerConfig(smollm2_dir, kv_budget_bytes=KV_BUDGET, block_size=16,
                                    kv_cache_dtype="float32"))  # as tiny_runner's


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir: Path) -> Any:
    """transformers' own model on the converted folder: the reference forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


@pytest.fixture(scope="module")
def int_dot_kernel(cache_dir: Path) -> None:
    """The integer-dot kernel loaded (engine_worker/int_dot.py), or the test skipped saying why."""
    from engine_worker import int_dot
    from engine_worker.kernel_build import KernelUnavailable

    try:
        int_dot.load(cache_dir)
    except KernelUnavailable as e:
        pytest.skip(f"the int_dot kernel is not available here: {e}")
