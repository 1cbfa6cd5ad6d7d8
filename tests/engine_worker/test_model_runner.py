"""Tests for engine_worker/model_runner.py: cached decode equals recomputation, batches equal
their items run alone, and the runner's sizes and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from engine_worker.kv_cache import kv_cache_bytes, kv_torch_dtype
from engine_worker.model.tokenizer import tokenizer_info
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem
from tests.numerics import assert_logits_close, first_near_tie, top2_gap


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (n,), generator=g).tolist()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two float32 paths of ours (cached and recomputed, batched and alone): within a few dozen
    float32 units of the largest logit, the same argmax wherever `b` is not tied within that."""
    assert_logits_close(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))


def greedy_check(runner: ModelRunner, prompt: list[int], steps: int,
                 table: list[int]) -> tuple[list[int], list[float]]:
    """Decode greedily through the cache, checking each step against a full recomputation; the
    tokens follow the recomputation (a near tie may go either way through the cache). Returns
    the tokens and the recomputation's top-two gap at each."""
    seq, gaps = list(prompt), []
    logits = runner.execute([StepItem(prompt, 0, table)])[0]  # (V,)
    for step in range(steps):
        ref = runner.forward_full(seq)[-1]  # (V,) recomputed from scratch, no cache
        try:
            close(logits, ref)
        except AssertionError as e:
            raise AssertionError(f"step {step}: {e}") from None
        gaps.append(float(top2_gap(ref)))
        seq.append(int(ref.argmax()))
        logits = runner.execute([StepItem([seq[-1]], len(seq) - 1, table)])[0]
    return seq[len(prompt) :], gaps


@pytest.mark.parametrize(
    "table",
    [
        [9, 3, 7, 0, 12, 5, 1, 10],  # out of order: a wrong block lookup cannot pass by luck
        list(range(40, 48)),  # consecutive: read as a view, not gathered
    ],
    ids=["scattered", "consecutive"],
)
def test_cached_greedy_decode_equals_recompute_tiny(
    tiny_runner: ModelRunner, table: list[int]
) -> None:
    # 8 blocks * 16 = 128 >= 20 + 100 positions
    out, _ = greedy_check(tiny_runner, random_ids(20, seed=0), 100, table)
    assert len(out) == 100


@pytest.mark.smollm
def test_cached_greedy_decode_equals_recompute_smollm2(
    smollm2_runner: ModelRunner, smollm2_dir: Path
) -> None:
    info = tokenizer_info(smollm2_dir)
    tok = Tokenizer.from_str(info.tokenizer_json)
    text = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France? Answer with one "
        "word.<|im_end|>\n<|im_start|>assistant\n"
    )
    prompt = tok.encode(text, add_special_tokens=False).ids
    out, gaps = greedy_check(smollm2_runner, prompt, 32, [4, 2, 6, 1, 3, 0])
    decisive = tok.decode(out[:first_near_tie(gaps)])  # content is checked only this far
    assert "Paris" in decisive, (decisive, gaps)


def test_mixed_batch_equals_each_item_alone(tiny_runner: ModelRunner) -> None:
    run = tiny_runner.execute
    tables = {  # interleaved, out-of-order blocks per sequence
        "a": [20, 31, 22],
        "b": [33, 24],
        "c": [25, 36, 27, 38],
        "d": [39, 30, 41, 42],
        "e": [43],
    }
    prompts = {
        k: random_ids(n, seed=i)
        for i, (k, n) in enumerate([("a", 21), ("b", 5), ("c", 40), ("d", 50), ("e", 12)])
    }
    for k in "abc":  # three sequences that will decode, each with a different context length
        run([StepItem(prompts[k], 0, tables[k])])
    run([StepItem(prompts["d"][:30], 0, tables["d"])])  # the first chunk of d

    nxt = {k: random_ids(1, seed=10 + i)[0] for i, k in enumerate("abc")}
    items = [
        StepItem([nxt["a"]], 21, tables["a"]),
        StepItem(prompts["d"][30:], 30, tables["d"]),  # d's second chunk, after cached tokens
        StepItem([nxt["b"]], 5, tables["b"]),
        StepItem(prompts["e"], 0, tables["e"]),  # a fresh prefill
        StepItem([nxt["c"]], 40, tables["c"]),
    ]
    alone = torch.cat([run([it]) for it in items])  # (5, V)
    batched = run(items)  # (5, V), rows in the items' order
    assert batched.shape == alone.shape == (5, tiny_runner.config.vocab_size)
    for i in range(len(items)):
        close(batched[i], alone[i])
    # and the chunked prefill of d equals d's whole prompt recomputed
    close(batched[1], tiny_runner.forward_full(prompts["d"])[-1])
    close(batched[0], tiny_runner.forward_full(prompts["a"] + [nxt["a"]])[-1])


def test_a_bfloat16_cache_under_float32_activations_follows_the_recomputation(
    tiny_dir: Path, tiny_runner: ModelRunner
) -> None:
    """Issue 53: the default CPU cache (bfloat16, float32 activations) through a greedy
    decode, read in place: each step within bfloat16's rounding of the float32 recomputation
    without a cache, and its greedy tokens those of the recomputation wherever that one's top
    two are not near a tie."""
    runner = ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=1 << 20, block_size=16))
    assert runner.kv_cache.dtype == torch.bfloat16 and runner.dtype == torch.float32
    seq, table = random_ids(20, seed=0), [9, 3, 7, 0, 12, 5, 1, 10]
    logits = runner.execute([StepItem(seq, 0, table)])[0]  # (V,)
    for _ in range(60):
        ref = tiny_runner.forward_full(seq)[-1]  # (V,) float32, no cache
        top2 = torch.topk(ref, 2).values
        # K/V rounded to 8 significant bits move a logit by a few 1e-3 here
        assert (logits - ref).abs().max() < 0.05 * ref.abs().max()
        if top2[0] - top2[1] > 0.05:
            assert logits.argmax() == ref.argmax()
        seq.append(int(ref.argmax()))
        logits = runner.execute([StepItem([seq[-1]], len(seq) - 1, table)])[0]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_an_8_bit_cache_follows_the_recomputation(tiny_dir: Path, tiny_runner: ModelRunner,
                                                  kv: str) -> None:
    """Issue 53: --kv-cache-dtype int8 / fp8 through the runner: a prompt prefilled in two
    chunks (the second reads the first's codes back through the gather path), then greedy
    decodes read in place; each step near the float32 recomputation without a cache, the same
    token wherever that one's top two are apart, and the in-place kernel's logits the gather
    path's over the same codes."""
    runner = ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=1 << 20, block_size=16,
                                      kv_cache_dtype=kv))
    assert runner.kv_cache.dtype == kv_torch_dtype(kv) and runner.paged_attention.enabled
    seq, table = random_ids(40, seed=1), [9, 3, 7, 0, 12, 5, 1, 10]
    runner.execute([StepItem(seq[:24], 0, table)])
    logits = runner.execute([StepItem(seq[24:], 24, table)])[0]  # (V,)
    for step in range(40):
        ref = tiny_runner.forward_full(seq)[-1]  # (V,) float32, no cache
        top2 = torch.topk(ref, 2).values
        # K/V in 8 bits: fp8 keeps 4 significant bits, int8 ~7 of a group's largest
        assert (logits - ref).abs().max() < 0.1 * ref.abs().max(), step
        if top2[0] - top2[1] > 0.2:
            assert logits.argmax() == ref.argmax(), step
        seq.append(int(ref.argmax()))
        item = StepItem([seq[-1]], len(seq) - 1, table)
        logits = runner.execute([item])[0]
        if step % 10 == 0:  # rewriting the same slot is idempotent: the gather path's answer
            runner.set_paged_attention(False)
            try:
                gathered = runner.execute([item])[0]
            finally:
                runner.set_paged_attention(True)
            assert torch.allclose(logits, gathered, atol=1e-4, rtol=1e-4), step


def test_bf16_cached_decode_mostly_follows_float32(
    tiny_dir: Path, tiny_runner: ModelRunner
) -> None:
    bf16 = ModelRunner(RunnerConfig(tiny_dir, dtype="bfloat16", kv_budget_bytes=1 << 20))
    seq = random_ids(16, seed=5) + random_ids(40, seed=6)
    ref = tiny_runner.forward_full(seq).argmax(-1)  # (T,) float32 choices
    table = [3, 0, 2, 1]
    rows = [bf16.execute([StepItem(seq[:16], 0, table)])]
    for pos in range(16, len(seq)):  # teacher-forced: the same tokens whatever bf16 picks
        rows.append(bf16.execute([StepItem([seq[pos]], pos, table)]))
    logits = torch.cat(rows)  # (41, V)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    agree = (logits.argmax(-1) == ref[15:]).float().mean().item()
    assert agree >= 0.75, agree


def test_sizes_follow_budget_and_checkpoint(tiny_dir: Path, tiny_runner: ModelRunner) -> None:
    from safetensors.torch import load_file

    cfg = tiny_runner.config
    per_block = kv_cache_bytes(cfg, tiny_runner.block_size, torch.float32)
    assert tiny_runner.num_blocks == (64 << 20) // per_block
    assert tiny_runner.kv_cache.nbytes == tiny_runner.num_blocks * per_block
    # context: the checkpoint's 2048, as the cache holds more
    assert tiny_runner.max_model_len == 2048 < tiny_runner.kv_cache.capacity_tokens
    file_bytes = sum(t.nbytes for t in load_file(str(tiny_dir / "model.safetensors")).values())
    assert tiny_runner.weight_bytes == file_bytes  # tied head counted once, like the file

    f32 = {"kv_cache_dtype": "float32"}
    small = ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=10 * per_block, block_size=16,
                                     **f32))
    assert small.max_model_len == 160  # clamped to what the cache holds
    # the default bfloat16 cache: twice the tokens in the same budget
    assert ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=10 * per_block,
                                    block_size=16)).max_model_len == 320
    short = RunnerConfig(tiny_dir, kv_budget_bytes=per_block, max_model_len=8, **f32)
    assert ModelRunner(short).max_model_len == 8
    with pytest.raises(ValueError, match="less than one block"):
        ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=per_block - 1, **f32))
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=10 * per_block, max_model_len=161,
                                 **f32))


def test_execute_refuses_bad_items(tiny_runner: ModelRunner) -> None:
    bad = [
        [],
        [StepItem([], 0, [0])],
        [StepItem([1] * 17, 0, [0])],  # 17 tokens need two blocks
        [StepItem([1], 2048, list(range(129)))],  # past max_model_len
        [StepItem([1], 0, [tiny_runner.num_blocks])],  # no such block
    ]
    for items in bad:
        with pytest.raises(ValueError):
            tiny_runner.execute(items)
