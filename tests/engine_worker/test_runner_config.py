"""The runner's config is built once from the worker's settings, and the draft runner's from it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine_worker import memory_budget
from engine_worker.config import WorkerConfig, cache_dir_from_env
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import AUTO, RunnerConfig
from engine_worker.speculative.build import build_spec_decoder
from engine_worker.speculative.draft import DraftModelProposer


def settings(tiny_dir: Path, **kw: object) -> WorkerConfig:
    return WorkerConfig(model=str(tiny_dir), cache_dir=str(cache_dir_from_env()), **kw)


def test_from_worker_takes_every_runner_setting(tiny_dir: Path) -> None:
    cfg = RunnerConfig.from_worker(settings(
        tiny_dir, dtype="bfloat16", quantization="int8", quant_group_size=64, dense_min_rows=0,
        paged_attention="gather", compile="decode", block_size=32, max_model_len=512,
        max_num_seqs=8, threads=1, kv_cache_memory="3MiB", kv_cache_dtype="float16"))
    assert cfg == RunnerConfig(
        model_path=tiny_dir, kv_budget_bytes=3 << 20, kv_budget_why="--kv-cache-memory 3MiB",
        dtype="bfloat16", kv_cache_dtype="float16", quantization="int8",
        group_size=64, dense_min_rows=0, paged_attention="gather", compile_mode="decode",
        block_size=32, max_model_len=512, max_num_seqs=8, num_threads=1,
        cache_dir=cache_dir_from_env())


def test_defaults_and_the_kv_budget(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RunnerConfig.from_worker(settings(tiny_dir, kv_cache_mb=7))
    assert cfg.kv_budget_bytes == 7 << 20
    assert (cfg.dtype, cfg.gguf_path, cfg.max_model_len, cfg.num_threads) == (
        "float32", None, None, None)  # a float folder in its own dtype; 0s mean "not set"
    assert cfg.dense_min_rows == AUTO
    monkeypatch.setattr(memory_budget, "available_bytes", lambda device: 1 << 30)
    cfg = RunnerConfig.from_worker(settings(tiny_dir, kv_cache_mb=7, kv_cache_memory="0.25"))
    assert cfg.kv_budget_bytes == 1 << 28  # a fraction of what is available wins over the MiB


def test_the_default_cache_is_bfloat16_and_holds_whole_contexts(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 53: no budget given, the cache takes a share of the memory available, at most what
    --max-num-seqs whole contexts of the model hold, in bfloat16 on a CPU."""
    from engine_worker.model.loader import load_config

    model = load_config(tiny_dir)
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2  # bfloat16
    whole = per_token * model.max_position_embeddings * 8
    monkeypatch.setattr(memory_budget, "available_bytes", lambda device: 1 << 40)
    cfg = RunnerConfig.from_worker(settings(tiny_dir, max_num_seqs=8))
    assert cfg.kv_cache_dtype == "bfloat16" and cfg.dtype == "float32"
    assert cfg.kv_budget_bytes == whole and "whole context" in cfg.kv_budget_why
    monkeypatch.setattr(memory_budget, "available_bytes", lambda device: whole)  # a small host
    cfg = RunnerConfig.from_worker(settings(tiny_dir, max_num_seqs=8))
    assert cfg.kv_budget_bytes == int(memory_budget.AUTO_SHARE * whole)
    runner = ModelRunner(cfg)
    assert runner.kv_cache.dtype == torch.bfloat16
    assert runner.kv_cache.nbytes <= cfg.kv_budget_bytes
    assert runner.max_model_len == min(model.max_position_embeddings,
                                       runner.num_blocks * runner.block_size)


@pytest.mark.parametrize("bad", [
    dict(dtype="half"), dict(quantization="int3"), dict(group_size=48),
    dict(compile_mode="all"), dict(paged_attention="never"), dict(block_size=0),
    dict(gguf_path=Path("x.gguf"), quantization="int8"),
    dict(gguf_path=Path("x.gguf"), dtype="bfloat16"),
])
def test_bad_configs_are_refused(tiny_dir: Path, bad: dict) -> None:
    with pytest.raises(ValueError):
        RunnerConfig(tiny_dir, kv_budget_bytes=1 << 20, **bad)


def test_benchmarks_build_it_as_the_worker_does(tiny_dir: Path) -> None:
    worker = RunnerConfig.from_worker(settings(tiny_dir, kv_cache_mb=64, dtype="float32"))
    assert RunnerConfig.from_settings(tiny_dir, kv_cache_mb=64, dtype="float32") == worker
    assert replace(worker, compile_mode="decode").kv_budget_bytes == 64 << 20


def test_the_draft_and_target_caches_share_kv_cache_memory(tiny_dir: Path) -> None:
    cfg = settings(tiny_dir, speculative_method="draft", draft_model=str(tiny_dir),
                   kv_cache_mb=64, kv_cache_memory="2MiB", compile="off")
    runner = ModelRunner(RunnerConfig.from_worker(cfg))
    spec = build_spec_decoder(cfg, runner)
    assert spec is not None and isinstance(spec.proposer, DraftModelProposer)
    draft = spec.proposer.runner
    # the two caches share the budget, in proportion to their bytes a token (the same model
    # here: halves, and the same number of blocks)
    assert draft.runner_config.kv_budget_bytes + runner.runner_config.kv_budget_bytes == 2 << 20
    assert draft.runner_config.kv_budget_bytes == runner.runner_config.kv_budget_bytes
    assert draft.num_blocks == runner.num_blocks
    assert draft.runner_config == runner.runner_config.for_draft(tiny_dir)


def test_for_draft_keeps_the_host_settings_and_drops_the_served_models() -> None:
    served = RunnerConfig(Path("served"), kv_budget_bytes=5 << 20, dtype="bfloat16",
                          quantization="int4", group_size=64, dense_min_rows=8,
                          paged_attention="gather", compile_mode="decode", block_size=32,
                          max_model_len=1024, num_threads=2, cache_dir=Path("c"))
    draft = served.for_draft(Path("draft"))
    assert (draft.model_path, draft.kv_budget_bytes, draft.dtype, draft.device,
            draft.paged_attention, draft.block_size, draft.cache_dir) == (
        Path("draft"), 5 << 20, "bfloat16", "cpu", "gather", 32, Path("c"))
    assert (draft.gguf_path, draft.quantization, draft.dense_min_rows, draft.compile_mode,
            draft.max_model_len, draft.num_threads) == (None, "none", AUTO, "off", None, None)
