"""Tests for engine_worker/kv_cache.py: the byte calculator agrees with what is allocated, and
the 8-bit caches' rows hold codes and per-group scales that decode within one code's error."""

from __future__ import annotations

import pytest
import torch

from engine_worker.kv_cache import (
    KVCache,
    decode,
    encode,
    gather,
    head_major,
    kv_cache_bytes,
    kv_torch_dtype,
    num_blocks_for_budget,
    row_width,
    write,
)
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8,
                                   torch.float8_e4m3fn])
def test_calculator_equals_allocated_bytes(cfg: ModelConfig, dtype: torch.dtype) -> None:
    cache = KVCache(cfg, num_blocks=7, block_size=16, dtype=dtype, device="cpu")
    assert cache.capacity_tokens == 7 * 16
    allocated = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert kv_cache_bytes(cfg, cache.capacity_tokens, dtype) == allocated == cache.nbytes
    assert len(cache.k) == len(cache.v) == cfg.num_layers
    assert cache.k[0].shape == (cfg.num_kv_heads, 7 * 16, row_width(cfg.head_dim, dtype))
    assert all(t.dtype == dtype for t in cache.k + cache.v)


def test_smollm2_float32_figure() -> None:
    # 2 (K and V) * 30 layers * 3 heads * 64 dims * 4 bytes = 46080 bytes per token
    assert kv_cache_bytes(SMOLLM2_LIKE, 1, torch.float32) == 46080
    assert kv_cache_bytes(SMOLLM2_LIKE, 10, torch.bfloat16) == 230400


def test_an_8_bit_cache_is_about_half_a_16_bit_one() -> None:
    # a head of 128: 128 codes and 4 float16 scales, 136 bytes against bfloat16's 256
    assert kv_cache_bytes(LLAMA_LIKE, 1, torch.int8) * 256 \
        == kv_cache_bytes(LLAMA_LIKE, 1, torch.bfloat16) * 136
    assert kv_cache_bytes(LLAMA_LIKE, 1, torch.float8_e4m3fn) \
        == kv_cache_bytes(LLAMA_LIKE, 1, torch.int8)
    assert kv_torch_dtype("fp8") == torch.float8_e4m3fn and kv_torch_dtype("int8") == torch.int8
    assert kv_torch_dtype("bfloat16") == torch.bfloat16


@pytest.mark.parametrize("name,top,err", [("int8", 127, 0.5), ("fp8", 448, 1 / 16)])
@pytest.mark.parametrize("d", [64, 128, 16])
def test_an_8_bit_row_is_codes_then_a_float16_scale_per_group(name: str, top: int, err: float,
                                                              d: int) -> None:
    dtype = kv_torch_dtype(name)
    g = torch.Generator().manual_seed(d)
    x = torch.randn(9, 2, d, generator=g) * torch.logspace(-2, 2, 9).view(9, 1, 1)
    x[0, 0] = 0.0  # an all-zero row: scale 0, codes 0, decoded as zeros
    x[1, 1, 5] = 300.0  # an outlier spoils only its own group's scale
    rows = encode(x, dtype)
    groups = d // 32 if d % 32 == 0 else 1
    assert rows.shape == (9, 2, d + 2 * groups) and rows.dtype == dtype
    scales = rows.view(torch.int8)[..., d:].contiguous().view(torch.float16).float()
    amax = x.view(9, 2, groups, d // groups).abs().amax(-1)
    assert torch.allclose(scales, amax / top, rtol=1e-3)  # the group's largest over the top code
    back = decode(rows, d, torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(d))
    step = scales.repeat_interleave(d // groups, dim=-1)  # one code's worth, per value
    if name == "int8":  # rounded to nearest: within half a code
        assert ((back - x).abs() <= step * err * 1.001 + 1e-7).all()
        assert rows.view(torch.int8)[..., :d].abs().max() == 127
    else:  # e4m3: 3 mantissa bits, within 1/16 of the value (or of the smallest normal)
        bound = torch.maximum(x.abs() * err, step * 2.0**-6 * err)
        assert ((back - x).abs() <= bound * 1.001 + 1e-7).all()
    if d > 32:  # the outlier's neighbours in other groups keep their precision
        assert (back[1, 1, 32:] - x[1, 1, 32:]).abs().max() < 0.1 * x[1, 1, 32:].abs().max()


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
    hkv, d = LLAMA_LIKE.num_kv_heads, LLAMA_LIKE.head_dim
    value = torch.arange(hkv * d, dtype=torch.float32).view(1, hkv, d) + 1
    write(cache.k[0], torch.tensor([2 * 8 + 5]), value)
    # slot 21 of each head: a head's rows lie in their own run, in slot order
    assert torch.equal(cache.k[0][:, 21], value[0])
    assert cache.k[0].sum().item() == value.sum().item()  # written in place, nowhere else
    with pytest.raises(ValueError):
        KVCache(LLAMA_LIKE, num_blocks=0, block_size=8, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_gather_reads_back_what_write_wrote(dtype: torch.dtype) -> None:
    """Slots written in any order read back in a sequence's order, by block table or by a run
    of consecutive blocks, the same as the slot-ordered rows put in the cache's layout."""
    cache = KVCache(LLAMA_LIKE, num_blocks=6, block_size=4, dtype=dtype, device="cpu")
    hkv, d = LLAMA_LIKE.num_kv_heads, LLAMA_LIKE.head_dim
    rows = torch.randn(24, hkv, d, generator=torch.Generator().manual_seed(0))
    order = torch.randperm(24, generator=torch.Generator().manual_seed(1))
    write(cache.k[0], order, rows[order])
    stored = encode(rows, dtype)  # (slots, Hkv, W) as the cache holds them
    assert torch.equal(cache.k[0].view(torch.int8), head_major(stored).view(torch.int8))
    table = torch.tensor([4, 1, 3, 0, 5, 2])  # two tables of three blocks, 10 positions each
    got = gather(cache.k[0], table, 2, 10, 4)  # (2, Hkv, T, W)
    for i, blocks in enumerate(((4, 1, 3), (0, 5, 2))):
        want = torch.cat([stored[4 * blk: 4 * blk + 4] for blk in blocks])[:10]
        assert torch.equal(got[i].view(torch.int8), want.transpose(0, 1).view(torch.int8))
    run = gather(cache.k[0], 2, 1, 7, 4)  # blocks 2, 3 as a run: a view
    assert torch.equal(run.view(torch.int8), stored[8:15].transpose(0, 1)[None].view(torch.int8))
    assert run.data_ptr() == cache.k[0][:, 8:].data_ptr()
