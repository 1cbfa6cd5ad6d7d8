"""Tests for engine_worker/kv_cache.py: the byte calculator agrees with what is allocated."""

from __future__ import annotations

import pytest
import torch

from engine_worker.kv_cache import KVCache, kv_cache_bytes, num_blocks_for_budget
from engine_worker.model.config import ModelConfig


def make_config(layers: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig.from_hf_dict(
        {
            "vocab_size": 100,
            "hidden_size": 4 * kv_heads * head_dim,
            "intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": 4 * kv_heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
        }
    )


SMOLLM2_LIKE = make_config(layers=30, kv_heads=3, head_dim=64)
LLAMA_LIKE = make_config(layers=4, kv_heads=8, head_dim=128)


@pytest.mark.parametrize("cfg", [SMOLLM2_LIKE, LLAMA_LIKE], ids=["smollm2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calculator_equals_allocated_bytes(cfg: ModelConfig, dtype: torch.dtype) -> None:
    cache = KVCache(cfg, num_blocks=7, block_size=16, dtype=dtype, device="cpu")
    assert cache.capacity_tokens == 7 * 16
    allocated = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert kv_cache_bytes(cfg, cache.capacity_tokens, dtype) == allocated == cache.nbytes
    assert len(cache.k) == len(cache.v) == cfg.num_layers
    assert cache.k[0].shape == (7 * 16, cfg.num_kv_heads, cfg.head_dim)
    assert all(t.dtype == dtype for t in cache.k + cache.v)


def test_smollm2_float32_figure() -> None:
    # 2 (K and V) * 30 layers * 3 heads * 64 dims * 4 bytes = 46080 bytes per token
    assert kv_cache_bytes(SMOLLM2_LIKE, 1, torch.float32) == 46080
    assert kv_cache_bytes(SMOLLM2_LIKE, 10, torch.bfloat16) == 230400


def test_budget_buys_whole_blocks_only() -> None:
    block = kv_cache_bytes(SMOLLM2_LIKE, 16, torch.float32)
    assert num_blocks_for_budget(SMOLLM2_LIKE, 10 * block, 16, torch.float32) == 10
    assert num_blocks_for_budget(SMOLLM2_LIKE, 10 * block + block - 1, 16, torch.float32) == 10
    assert num_blocks_for_budget(SMOLLM2_LIKE, block - 1, 16, torch.float32) == 0
    # half the bytes per element: twice the blocks
    assert num_blocks_for_budget(SMOLLM2_LIKE, 10 * block, 16, torch.bfloat16) == 20
    with pytest.raises(ValueError):
        num_blocks_for_budget(SMOLLM2_LIKE, block, 0, torch.float32)


def test_slots_are_block_times_size_plus_offset() -> None:
    cache = KVCache(LLAMA_LIKE, num_blocks=4, block_size=8, dtype=torch.float32, device="cpu")
    value = torch.full((1, LLAMA_LIKE.num_kv_heads, LLAMA_LIKE.head_dim), 3.0)
    cache.k[0].index_copy_(0, torch.tensor([2 * 8 + 5]), value)
    paged = cache.k[0].view(4, 8, LLAMA_LIKE.num_kv_heads, LLAMA_LIKE.head_dim)
    assert torch.equal(paged[2, 5], value[0])
    assert paged.sum().item() == value.sum().item()  # written in place, nowhere else
    with pytest.raises(ValueError):
        KVCache(LLAMA_LIKE, num_blocks=0, block_size=8, dtype=torch.float32, device="cpu")
