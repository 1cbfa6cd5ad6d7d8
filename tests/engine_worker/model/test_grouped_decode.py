"""The grouped decode attention (query heads of one KV head read K/V once, issue 10) equals the
enable_gqa path: per layer on scattered block tables with ragged contexts, per step through the
model runner, and token for token over 50 greedy steps through the engine."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_worker.kv_cache import head_major, kv_cache_bytes
from engine_worker.model.attention import Attention
from engine_worker.model.config import ModelConfig
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem
from tests.engine_worker.greedy_run import greedy_tokens


def gqa_config(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=32, hidden_size=heads * head_dim, intermediate_size=8, num_layers=1,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_ids=[0],
        model_type="llama",
    )


def test_grouped_decode_equals_enable_gqa_on_scattered_ragged_contexts() -> None:
    # G = 3 query heads per KV head (SmolLM2's 9/3), ragged lengths, out-of-order block tables
    h, hkv, d, bs = 6, 2, 16, 4
    attn = Attention(gqa_config(h, hkv, d))
    g = torch.Generator().manual_seed(0)
    k_slots = torch.randn(64 * bs, hkv, d, generator=g)  # (slots, Hkv, D)
    v_slots = torch.randn(64 * bs, hkv, d, generator=g)
    k_cache, v_cache = head_major(k_slots), head_major(v_slots)  # (Hkv, slots, D)
    ctx = torch.tensor([13, 5, 24, 1])  # context length of each sequence
    t_max, b = int(ctx.max()), len(ctx)
    nblk = -(-t_max // bs)
    blocks = torch.randperm(64, generator=g)[: b * nblk]  # (B * nblk,) never consecutive runs
    q = torch.randn(b, h, d, generator=g)  # (B, H, D)
    mask = (torch.arange(t_max) < ctx[:, None]).view(b, 1, 1, t_max)  # (B, 1, 1, T)
    kd, vd = attn._context(k_cache, v_cache, blocks, bs, b, t_max)  # (B, Hkv, T, D)
    ref = F.scaled_dot_product_attention(  # (B, H, 1, D)
        q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=True
    ).squeeze(2)
    got = attn._decode_grouped(q, kd, vd, mask)  # (B, H, D)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()
    # and against a loop that reads each sequence's own rows by its block table, head by head
    for i in range(b):
        slots = torch.cat([blocks[i * nblk + j] * bs + torch.arange(bs) for j in range(nblk)])
        slots = slots[: int(ctx[i])]
        for head in range(h):
            kh = k_slots[slots, head // (h // hkv)]  # (T_i, D)
            vh = v_slots[slots, head // (h // hkv)]
            w = torch.softmax(kh @ q[i, head] / d**0.5, dim=0)  # (T_i,)
            assert torch.allclose(got[i, head], w @ vh, atol=1e-5, rtol=1e-5)


def set_grouped(runner: ModelRunner, on: bool) -> None:
    # both sides on the gather path: the in-place kernel (test_paged_attention) would bypass it
    runner.set_paged_attention(False)
    for layer in runner.model.model.layers:
        layer.self_attn.grouped_decode = on


def test_runner_decode_step_logits_equal_both_paths(tiny_runner: ModelRunner) -> None:
    rng = random.Random(0)
    items = []
    for i, length in enumerate([3, 40, 17, 29, 8]):  # ragged
        table = [200 + i + 5 * j for j in range(4)][::-1]  # scattered, 64 positions each
        ids = [rng.randrange(3, 49152) for _ in range(length)]
        tiny_runner.execute([StepItem(ids, 0, table)])
        items.append(StepItem([rng.randrange(3, 49152)], length, table))
    try:
        set_grouped(tiny_runner, False)
        ref = tiny_runner.execute(items)  # (B, V); rewriting the same k,v slots is idempotent
        set_grouped(tiny_runner, True)
        got = tiny_runner.execute(items)
    finally:
        set_grouped(tiny_runner, True)
        tiny_runner.set_paged_attention(tiny_runner.paged_attention.enabled)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


def engine_tokens(tiny_dir: Path, grouped: bool) -> dict[str, list[int]]:
    probe = ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=1 << 20))
    budget = kv_cache_bytes(probe.config, 256 * 16, torch.float32)
    runner = ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=budget, block_size=16))
    set_grouped(runner, grouped)
    return greedy_tokens(runner, (("a", 5), ("b", 33), ("c", 70), ("d", 12)), 1)


def test_engine_greedy_50_steps_identical_with_grouped_decode(tiny_dir: Path) -> None:
    ref, got = engine_tokens(tiny_dir, False), engine_tokens(tiny_dir, True)
    assert all(len(t) == 50 for t in got.values()) and len(got) == 4
    assert got == ref
